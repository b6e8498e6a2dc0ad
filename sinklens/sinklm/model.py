"""SinkLM: a small decoder with attention variants, with TransformerLens' hook names, shapes and weight properties
(plus each variant's hooks). A softmax variant uses SDPA unless its scores or pattern are hooked."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from sinklens.errors import InvalidArgumentError
from sinklens.sinklm.config import ModelConfig
from sinklens.sinklm.functional import next_token_loss, rope, rotary_tables
from sinklens.sinklm.variants import AttentionVariant, HeadwiseRMSNorm, at_least_float32, get_attention_variant, rms_norm
from sinklens.validate import as_seed

def _no_decay(p: nn.Parameter) -> nn.Parameter:
    p._no_weight_decay = True  # type: ignore[attr-defined]
    return p


def _hooked(hp: HookPoint) -> bool:
    """True when a forward or backward hook is attached to ``hp`` (then the explicit path runs)."""
    return bool(hp.fwd_hooks or hp.bwd_hooks or hp._forward_hooks or hp._backward_hooks)


def _stacked(get: Any) -> property:
    """A read-only property stacking ``get(block)`` over the layers."""
    return property(lambda self: torch.stack([get(block) for block in self.blocks]))


def _bias(module: nn.Module, name: str, weight: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``module.name``, or zeros shaped like ``weight``'s ``dims`` where the family has no such bias."""
    return getattr(module, name) if hasattr(module, name) else weight.new_zeros([weight.shape[d] for d in dims])


class RMSNorm(nn.Module):
    """``w ⊙ x / sqrt(mean(x²) + eps)`` in float32; ``hook_normalized`` is before ``w``, as in TransformerLens."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.w = _no_decay(nn.Parameter(torch.ones(d_model)))
        self.hook_scale, self.hook_normalized = HookPoint(), HookPoint()

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if not (_hooked(self.hook_scale) or _hooked(self.hook_normalized)):
            return rms_norm(x, self.w, self.eps)
        xf = at_least_float32(x)
        scale = self.hook_scale((xf.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized((xf / scale).to(x.dtype)) * self.w.to(x.dtype)


class LayerNorm(RMSNorm):
    """``w ⊙ (x - mean) / sqrt(var + eps) + b`` (float32); ``hook_normalized`` is ``(x - mean) / sqrt(...)``, before
    ``w`` and ``b``, as in TransformerLens' ``LayerNorm``."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__(d_model, eps)
        self.b = _no_decay(nn.Parameter(torch.zeros(d_model)))

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        xf = at_least_float32(x)
        xf = xf - xf.mean(-1, keepdim=True)
        scale = self.hook_scale((xf.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized((xf / scale).to(x.dtype)) * self.w.to(x.dtype) + self.b.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with TransformerLens parameters and hooks; query head ``h`` reads kv head
    ``h // (n_heads // n_kv_heads)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, Hkv, D, dh = cfg.n_heads, cfg.n_key_value_heads, cfg.d_model, cfg.d_head
        for name, shape in (("W_Q", (H, D, dh)), ("W_K", (Hkv, D, dh)), ("W_V", (Hkv, D, dh)), ("W_O", (H, dh, D))):
            setattr(self, name, nn.Parameter(torch.empty(shape)))
        self.has_bias = cfg.family == "gpt2"
        if self.has_bias:
            for name, shape in (("b_Q", (H, dh)), ("b_K", (Hkv, dh)), ("b_V", (Hkv, dh)), ("b_O", (D,))):
                setattr(self, name, _no_decay(nn.Parameter(torch.zeros(shape))))
        self.variant: AttentionVariant = get_attention_variant(cfg.variant)(
            n_heads=H, d_head=dh, d_model=D, n_ctx=cfg.n_ctx, init_std=cfg.init_std, **cfg.variant_options
        )
        self.rotary = cfg.family == "llama"
        if self.rotary:
            for name, table in zip(("rope_cos", "rope_sin"), rotary_tables(cfg.n_ctx, dh, cfg.rope_base)):
                self.register_buffer(name, table, persistent=False)  # computed once, moved with the model
        rotated = ("hook_rot_q", "hook_rot_k") if self.rotary else ()
        for site in ("hook_q", "hook_k", "hook_v", *rotated, "hook_attn_scores", "hook_pattern", "hook_z",
                     *self.variant.hook_sites):
            setattr(self, site, HookPoint())

    def project(self, x: Float[Tensor, "batch pos d_model"]) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``[batch, pos, head, d_head]``, keys/values ``[batch, pos, kv_head, d_head]``, hooked; one matmul."""
        B, T, D = x.shape
        H, Hkv = self.cfg.n_heads, self.cfg.n_key_value_heads
        w = torch.cat([self.W_Q, self.W_K, self.W_V], dim=0).to(x.dtype)  # (H + 2Hkv, D, dh)
        qkv = (x @ w.transpose(0, 1).reshape(D, -1)).view(B, T, H + 2 * Hkv, -1)  # (B, T, H + 2Hkv, dh)
        q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
        if self.has_bias:
            q, k, v = q + self.b_Q.to(q.dtype), k + self.b_K.to(k.dtype), v + self.b_V.to(v.dtype)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        q, k = self.variant.transform_qk(q, k, self)
        if self.rotary:
            q = self.hook_rot_q(rope(q, self.rope_cos, self.rope_sin))
            k = self.hook_rot_k(rope(k, self.rope_cos, self.rope_sin))
        return q, k, v

    def needs_explicit(self) -> bool:
        """True if the scores/pattern must be materialised: a non-softmax variant or a hook on them."""
        return not self.variant.uses_sdpa or _hooked(self.hook_attn_scores) or _hooked(self.hook_pattern)

    def aggregate(self, q: Tensor, k: Tensor, v: Tensor, *, explicit: bool) -> Float[Tensor, "batch pos head d_head"]:
        """The raw head outputs ``z = Σ_k pattern[q, k] v_k`` (before ``hook_z``)."""
        rep = self.cfg.n_heads // self.cfg.n_key_value_heads
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if not explicit:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        T = q.shape[2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.cfg.d_head)  # (B, nh, T, T)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        scores = self.hook_attn_scores(self.variant.logits(scores))
        pattern = self.hook_pattern(self.variant.normalize(scores))
        return (pattern.to(v.dtype) @ v).transpose(1, 2)

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        q, k, v = self.project(x)
        self.variant.aggregating(q, k)
        z = self.hook_z(self.aggregate(q, k, v, explicit=self.needs_explicit()))
        z = self.variant.transform_z(z, x, self)
        out = z.flatten(2) @ self.W_O.to(z.dtype).flatten(0, 1)  # (B, T, H·dh) @ (H·dh, D)
        return out + self.b_O.to(out.dtype) if self.has_bias else out


class MLP(nn.Module):
    """SwiGLU (llama: ``W_gate``, ``W_in``, ``W_out``) or GELU (gpt2: ``W_in``, ``b_in``, ``W_out``, ``b_out``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, M = cfg.d_model, int(cfg.d_mlp)
        self.gated = cfg.family == "llama"
        self.W_in = nn.Parameter(torch.empty(D, M))
        self.W_out = nn.Parameter(torch.empty(M, D))
        self.hook_pre, self.hook_post = HookPoint(), HookPoint()
        if self.gated:
            self.W_gate = nn.Parameter(torch.empty(D, M))
            self.hook_pre_linear = HookPoint()
        else:
            self.b_in = _no_decay(nn.Parameter(torch.zeros(M)))
            self.b_out = _no_decay(nn.Parameter(torch.zeros(D)))

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if self.gated:
            pre = self.hook_pre(x @ self.W_gate.to(x.dtype))
            post = self.hook_post(F.silu(pre) * self.hook_pre_linear(x @ self.W_in.to(x.dtype)))
            return post @ self.W_out.to(post.dtype)
        pre = self.hook_pre(x @ self.W_in.to(x.dtype) + self.b_in.to(x.dtype))
        post = self.hook_post(F.gelu(pre, approximate="tanh"))
        return post @ self.W_out.to(post.dtype) + self.b_out.to(post.dtype)


class Block(nn.Module):
    """Pre-norm residual block: ``resid_mid = resid_pre + attn(ln1(.))``, ``resid_post = resid_mid + mlp(ln2(.))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        Norm = RMSNorm if cfg.family == "llama" else LayerNorm
        self.ln1 = Norm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln2 = Norm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        for site in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"):
            setattr(self, site, HookPoint())

    def forward(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        resid = self.hook_resid_mid(resid + self.dropout(self.hook_attn_out(self.attn(self.ln1(resid)))))
        return self.hook_resid_post(resid + self.dropout(self.hook_mlp_out(self.mlp(self.ln2(resid)))))


class SinkLM(HookedRootModule):
    """A decoder-only LM: ``llama`` (RMSNorm, SwiGLU, RoPE, GQA) or ``gpt2`` (LayerNorm, GELU, learned positions,
    biases), tied embeddings, attention variant ``cfg.variant``. Init as GPT-2: weights ~ N(0, init_std²),
    ``W_O``/``W_out`` ~ N(0, (init_std / sqrt(2·n_layers))²); a ``headwise_rms`` model then calibrates its gains
    (:func:`calibrate_headwise_gains`, seeded).

    Examples:
        >>> model = SinkLM(ModelConfig.from_preset("tiny", n_ctx=16, d_vocab=32))
        >>> model(torch.randint(0, 32, (2, 8))).shape
        torch.Size([2, 8, 32])
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"SinkLM needs a ModelConfig, got {type(cfg).__name__}.")
        if cfg.d_vocab == "auto":
            raise InvalidArgumentError("model.d_vocab='auto' must be resolved to the data's vocabulary before the model "
                                       "is built (sinklens.train.loop.train does it); pass a number to build a SinkLM.")
        self.cfg = cfg
        self.tokenizer: Any = None
        self.embed = nn.Module()
        self.embed.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))
        self.hook_embed = HookPoint()
        if cfg.family == "gpt2":
            self.pos_embed = nn.Module()
            self.pos_embed.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))
            self.hook_pos_embed = HookPoint()
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_final = (RMSNorm if cfg.family == "llama" else LayerNorm)(cfg.d_model, cfg.norm_eps)
        self._init_weights()
        variant = self.blocks[0].attn.variant
        if isinstance(variant, HeadwiseRMSNorm) and variant.options["init"] == "first_token":
            calibrate_headwise_gains(self)
        self.to(getattr(torch, cfg.dtype))  # a DType name is torch's
        self.setup()

    @torch.no_grad()
    def _init_weights(self) -> None:
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.W_E, std=std)
        if self.cfg.family == "gpt2":
            nn.init.normal_(self.W_pos, std=std)
        for block in self.blocks:
            gate = [block.mlp.W_gate] if block.mlp.gated else []
            for w in (block.attn.W_Q, block.attn.W_K, block.attn.W_V, block.mlp.W_in, *gate):
                nn.init.normal_(w, std=std)
            nn.init.normal_(block.attn.W_O, std=resid_std)
            nn.init.normal_(block.mlp.W_out, std=resid_std)

    def forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        return_type: Literal["logits", "loss", "both", None] = "logits",
        *,
        targets: Int[Tensor, "batch pos"] | None = None,
    ) -> Any:
        """Logits ``[batch, pos, d_vocab]`` of ``tokens`` (``pos <= n_ctx``), and/or the loss (``return_type``:
        ``"logits"``, ``"loss"``, ``"both"``, None): mean next-token cross-entropy in nats, float32, of
        ``logits[:, t]`` → ``tokens[:, t + 1]``, or → ``targets[:, t]`` when ``targets`` are given."""
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}.")
        if tokens.ndim == 1:
            tokens = tokens[None]
        if (T := tokens.shape[1]) > self.cfg.n_ctx:
            raise InvalidArgumentError(f"Sequence length {T} exceeds the model's context window n_ctx={self.cfg.n_ctx}; "
                                       f"pass at most {self.cfg.n_ctx} tokens per sequence.")
        resid = self.hook_embed(F.embedding(tokens, self.W_E))  # = W_E[tokens], with a dense backward kernel
        if self.cfg.family == "gpt2":
            resid = resid + self.hook_pos_embed(self.W_pos[:T].to(resid.dtype).expand_as(resid))
        resid = self.dropout(resid)
        for block in self.blocks:
            resid = block(resid)
        if return_type is None:
            return None
        x = self.ln_final(resid)
        logits = x @ self.W_E.to(x.dtype).T
        if return_type == "logits":
            return logits
        loss = next_token_loss(logits[:, :-1], tokens[:, 1:]) if targets is None else next_token_loss(logits, targets)
        return loss if return_type == "loss" else (logits, loss)

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """AdamW groups: parameters with ≥ 2 dims decayed (nanoGPT); biases, norm gains and parameters flagged
        ``_no_weight_decay`` (head-wise gains, sink logits) not."""
        params = [p for p in self.parameters() if p.requires_grad]
        skip = [p.ndim < 2 or getattr(p, "_no_weight_decay", False) for p in params]
        return [{"params": [p for p, s in zip(params, skip) if not s], "weight_decay": float(weight_decay)},
                {"params": [p for p, s in zip(params, skip) if s], "weight_decay": 0.0}]

    def num_params(self) -> int:
        """Number of parameters (the tied embedding once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token for MFU (nanoGPT / PaLM appendix B): ``6·N + 12·n_layers·n_heads·d_head·T``, ``N``
        the matmul parameters (the tied embedding once, no position table), ``T = seq_len`` (default ``n_ctx``)."""
        T = int(seq_len or self.cfg.n_ctx)
        n = self.num_params() - (self.W_pos.numel() if self.cfg.family == "gpt2" else 0)
        return 6.0 * n + 12.0 * self.cfg.n_layers * self.cfg.n_heads * self.cfg.d_head * T

    @property
    def head_output_site(self) -> str:
        """Attention hook site (``attn.hook_z`` / ``attn.hook_z_normed`` / ``attn.hook_z_gated``) that enters ``W_O``."""
        return "attn." + self.blocks[0].attn.variant.output_site

    def head_output_gain(self, layer: int) -> Float[Tensor, "head d_head"] | None:
        """``γ`` of layer ``layer``'s head outputs when they are ``c[b, t, h] · (γ[h] ⊙ hook_z[b, t, h])``
        (:meth:`~sinklens.sinklm.variants.AttentionVariant.output_gain`), else None."""
        return self.blocks[layer].attn.variant.output_gain()

    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.W_E

    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"]:
        if self.cfg.family != "gpt2":
            raise AttributeError("A llama-family SinkLM uses RoPE and has no W_pos.")
        return self.pos_embed.W_pos

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.W_E.T

    @property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        return torch.zeros(self.cfg.d_vocab, device=self.W_E.device, dtype=self.W_E.dtype)

    # TransformerLens' stacked weights, [layer, ...]; a bias the family lacks is zeros
    W_Q = _stacked(lambda b: b.attn.W_Q)  # [layer, head, d_model, d_head]
    W_K = _stacked(lambda b: b.attn.W_K)  # [layer, kv_head, d_model, d_head]
    W_V = _stacked(lambda b: b.attn.W_V)  # [layer, kv_head, d_model, d_head]
    W_O = _stacked(lambda b: b.attn.W_O)  # [layer, head, d_head, d_model]
    b_Q = _stacked(lambda b: _bias(b.attn, "b_Q", b.attn.W_Q, (0, 2)))  # [layer, head, d_head]
    b_K = _stacked(lambda b: _bias(b.attn, "b_K", b.attn.W_K, (0, 2)))  # [layer, kv_head, d_head]
    b_V = _stacked(lambda b: _bias(b.attn, "b_V", b.attn.W_V, (0, 2)))  # [layer, kv_head, d_head]
    b_O = _stacked(lambda b: _bias(b.attn, "b_O", b.attn.W_O, (2,)))  # [layer, d_model]
    W_in = _stacked(lambda b: b.mlp.W_in)  # [layer, d_model, d_mlp]
    W_out = _stacked(lambda b: b.mlp.W_out)  # [layer, d_mlp, d_model]
    b_in = _stacked(lambda b: _bias(b.mlp, "b_in", b.mlp.W_in, (1,)))  # [layer, d_mlp]
    b_out = _stacked(lambda b: _bias(b.mlp, "b_out", b.mlp.W_out, (1,)))  # [layer, d_model]

    @property
    def W_gate(self) -> Float[Tensor, "layer d_model d_mlp"] | None:
        return torch.stack([b.mlp.W_gate for b in self.blocks]) if self.cfg.family == "llama" else None


@torch.no_grad()
def calibrate_headwise_gains(model: SinkLM, *, n_sequences: int = 8, seed: int = 0) -> Float[Tensor, "layer head"]:
    """Set every head-wise RMSNorm gain to the first token's output std; returns the gains ``[layer, head]``.

    As ``init_headnorm_stats`` in Siquan-Li/Head-wise-RMSNorm: each layer alone gets ``x ~ N(0, 1)`` of shape
    ``[n_sequences, min(64, n_ctx), d_model]`` (generator seeded with ``seed``), and head ``h``'s gain is the
    population std over ``d_head`` of ``z[0, h]``, averaged over sequences (over heads when shared)."""
    if n_sequences < 1:
        raise ValueError(f"n_sequences must be >= 1, got {n_sequences}.")
    attns = [block.attn for block in model.blocks]
    if not isinstance(attns[0].variant, HeadwiseRMSNorm):
        raise ValueError(f"calibrate_headwise_gains needs a headwise_rms model, got variant {model.cfg.variant!r}.")
    gen = torch.Generator().manual_seed(as_seed(seed, what="seed"))
    gains = []
    for attn in attns:
        x = torch.randn(n_sequences, min(64, model.cfg.n_ctx), model.cfg.d_model, generator=gen)
        q, k, v = attn.project(x.to(model.W_E))
        z0 = attn.aggregate(q, k, v, explicit=False)[:, 0]  # (n_sequences, head, d_head)
        gains.append(z0.float().std(dim=-1, unbiased=False).mean(dim=0))
        gain = attn.variant.gain
        gain.copy_(gains[-1][:, None].expand_as(gain) if gain.ndim == 2 else gains[-1].mean().expand_as(gain))
    gains = torch.stack(gains)  # (layer, head)
    shared = attns[0].variant.gain.ndim == 1
    return gains.mean(dim=1, keepdim=True).expand_as(gains).clone() if shared else gains
