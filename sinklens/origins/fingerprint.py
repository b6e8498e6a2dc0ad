"""SeedPrint (Tong, Wang, Li et al., ICLR 2026, arXiv 2509.26404): do two models share their random initialization?
Follows ``seedprint.py`` ``run_test`` (analytical, coset, no aggregation), [their constants]; caveats: docs/origins.md.

1. Inputs, no BOS: ``N`` sequences of ``L`` ids from ``torch.randint(0, V)`` seeded [42], ``V = min(32000, d_vocab_a,
   d_vocab_b)``; or (``embedding``) ``N(μ, σ)`` embeddings replacing ``hook_embed``, ``μ, σ`` of the token embedding
   at init (:func:`embedding_stats_at_init`), one seeded ``[L, d_model]`` draw per sample.
2. Features: the final hidden state (after the final norm) at the last position, ``[N, d_model]``, float32.
3. Identity dims: per model the ``k`` dims with the smallest mean [``k = 400``, clipped to ``d_model``]; ``coset``
   keeps the intersection of both sets, ``base`` model A's.
4. ``softmax(h[:, idx] / 10, dim=1)``; 5. per-dimension Kendall τ-b across samples, mean ``τ̄``;
6. ``z = τ̄ / (σ_τ / sqrt(k))``, ``σ_τ² = 2(2N+5) / (9N(N-1))``; 7. ``p = min(1, 2 Φ̄(z))``, shared if ``p < α`` [0.01].
Ours: fewer than two shared dims or a non-finite τ̄ give ``z = p = NaN`` (theirs: ``p = 1``); a small vocabulary or
a shared input passed through (:func:`shared_input_z`) make a positive "inconclusive"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError
from sinklens.export import to_json
from sinklens.hooks import model_device, model_dims
from sinklens.inputs import TokenBatch
from sinklens.loading import load_model
from sinklens.loading.init import load_at_init
from sinklens.options import RunOptions, checked_options
from sinklens.origins.sites import final_state_site
from sinklens.origins.stats import (
    format_p_value, kendall_tau_null_std, max_shared_input_z, per_dim_kendall, samples_for_share, shared_last_token_share,
)
from sinklens.streaming import BatchFold, Reducer, stream
from sinklens.validate import as_seed, choice, finite_number, positive_int

#: The authors' constants (``seedprint.py`` / ``utils.py`` of YnezT0311/SeedPrints).
DEFAULT_BUFFER_K = 400
TEMPERATURE = 10.0
TOKEN_VOCAB = 32000
DEFAULT_SEED = 42
DEFAULT_ALPHA = 0.01
DEFAULT_SAMPLES = 2000  # test_foundation_models.py --num_samples (10000 for their toy models)
DEFAULT_SEQ_LEN = 1024  # --fingerprint_len
#: Token mode: above this expected share of samples sharing their last token, a positive is "inconclusive"
#: (measured false positives at alpha 0.01: 1.4% at a 25% share, 2.4% at 44%).
MAX_SHARED_LAST_TOKEN = 1 / 3
#: Fewest identity dims for which Kendall τ of a softmax is defined.
MIN_DIMS = 2

InputMode = Literal["token", "embedding"]
IdentityMode = Literal["coset", "base"]


@dataclass(repr=False, eq=False)
class FingerprintResult(CompactRepr):
    """The outcome of one SeedPrint test: ``p_value = min(1, 2 · P(Z > z))``, ``z = τ̄ / (σ_τ(N) / sqrt(k))``,
    ``tau_mean`` = ``τ̄``, ``n_dims`` = ``k``, ``n_samples`` = ``N``, ``same_lineage = p_value < alpha`` (None when
    :attr:`undefined`), ``log10_p`` unclipped, ``dims`` / ``tau`` per identity dim, ``caveats`` (reasons the
    p-value may not hold) and ``verdict``: ``same_lineage``, ``no_evidence`` or ``inconclusive``."""

    p_value: float
    z: float
    tau_mean: float
    n_dims: int
    n_samples: int
    same_lineage: bool | None
    alpha: float
    log10_p: float
    dims: list[int]
    tau: Float[Tensor, " dim"]
    settings: dict[str, Any] = field(default_factory=dict)
    caveats: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Every field and the verdict, strict-JSON-ready at full precision (non-finite numbers as None)."""
        return to_json({**{f.name: getattr(self, f.name) for f in fields(self)}, "verdict": self.verdict}, digits=None)

    @property
    def undefined(self) -> bool:
        """True when fewer than :data:`MIN_DIMS` identity dims were compared or ``tau_mean`` is not finite."""
        return self.n_dims < MIN_DIMS or not math.isfinite(self.tau_mean)

    @property
    def verdict(self) -> Literal["same_lineage", "no_evidence", "inconclusive"]:
        """``"inconclusive"`` when the statistic is :attr:`undefined` or ``p < alpha`` under a caveat."""
        if self.undefined or (self.same_lineage and self.caveats):
            return "inconclusive"
        return "same_lineage" if self.same_lineage else "no_evidence"

    def summary(self) -> str:
        why = "the statistic is undefined here" if self.undefined else "p < alpha but the test is not valid here"
        verdict = {"same_lineage": "SAME lineage", "no_evidence": "no evidence of shared lineage",
                   "inconclusive": f"INCONCLUSIVE, {why} (caveat below)"}[self.verdict]
        d_a, d_b = self.settings.get("widths", (0, 0))
        widths = f" (hidden sizes {d_a} and {d_b})" if d_a != d_b else ""
        line = (f"SeedPrint: {verdict} ({format_p_value(self.p_value, self.log10_p)}, z = {self.z:.2f}, mean tau = {self.tau_mean:.4f}, "
                f"{self.n_dims} identity dims{widths}, {self.n_samples} samples, alpha = {self.alpha})")
        return "\n".join([line, *(f"  caveat: {c}" for c in self.caveats)])


def _normed(h: Tensor, dims: list[int]) -> Tensor:
    """Step 4: ``softmax(h[:, dims] / 10, dim=1)`` in float32 on the CPU."""
    return torch.softmax(h.detach().float().cpu()[:, dims] / TEMPERATURE, dim=1)


def identity_dims(hidden: Float[Tensor, "sample dim"], buffer_k: int) -> list[int]:
    """The ``buffer_k`` dimensions with the smallest mean over samples (``topk(..., largest=False)``)."""
    return torch.topk(hidden.mean(dim=0), buffer_k, largest=False).indices.tolist()


def check_test_arguments(buffer_k: Any, identity_mode: Any, alpha: Any, *,
                         cli: bool = False) -> tuple[int, IdentityMode, float]:
    """``(buffer_k, identity_mode, alpha)`` validated; ``cli=True`` names the flags in the errors."""
    name = (lambda arg: "--" + arg.replace("_", "-")) if cli else (lambda arg: arg)
    return (positive_int(buffer_k, what=name("buffer_k"), minimum=MIN_DIMS),  # type: ignore[return-value]
            choice(identity_mode, ("coset", "base"), what=name("identity_mode")),
            finite_number(alpha, what=name("alpha"), low=0.0, high=1.0, low_open=True, high_open=True))


def _first(values: list[int], shown: int = 5) -> str:
    """``"3, 4, 5, 6, 7, ..."``: the first ``shown`` values, and an ellipsis when there are more."""
    return ", ".join(map(str, values[:shown])) + (", ..." if len(values) > shown else "")


def _finite_features(hidden: Float[Tensor, "sample dim"], what: str) -> Float[Tensor, "sample dim"]:
    """``hidden`` itself when every entry is finite; otherwise an :class:`InvalidArgumentError` naming ``what``."""
    bad = ~torch.isfinite(hidden)
    if bad.any():
        rows = bad.any(dim=1).nonzero().flatten().tolist()
        raise InvalidArgumentError(f"SeedPrint needs finite features, but {what} has {int(bad.sum())} non-finite values "
                                   f"(inf or NaN) in {len(rows)} of its {hidden.shape[0]} samples (rows {_first(rows)}): "
                                   "the model's output overflowed or is broken there.")
    return hidden


def _base_dims_within(dims: list[int], d_a: int, d_b: int) -> None:
    """Refuse ``identity_mode="base"`` where one of A's identity ``dims`` is outside B's width."""
    if outside := [dim for dim in dims if dim >= d_b]:
        raise InvalidArgumentError(
            f"identity_mode='base' reads B at A's identity dims, but dims {_first(outside)} are outside B's width: "
            f"hidden sizes {d_a} (A) and {d_b} (B); use identity_mode='coset' (--identity-mode coset, the default).")


def seedprint_test(
    hidden_a: Float[Tensor, "sample dim_a"], hidden_b: Float[Tensor, "sample dim_b"], *,
    buffer_k: int = DEFAULT_BUFFER_K, identity_mode: IdentityMode = "coset",
    alpha: float = DEFAULT_ALPHA,
) -> FingerprintResult:
    """Steps 3–7 of the module docstring on two ``[samples, dim]`` feature matrices (widths may differ).
    Fewer than :data:`MIN_DIMS` shared dims or a constant column give NaN ``z`` / ``p_value`` and a caveat."""
    from scipy.stats import norm

    if hidden_a.ndim != 2 or hidden_b.ndim != 2 or hidden_a.shape[0] != hidden_b.shape[0]:
        raise InvalidArgumentError(f"SeedPrint needs two [samples, hidden] matrices with the same number of rows (the "
                                   f"widths may differ), got {tuple(hidden_a.shape)} and {tuple(hidden_b.shape)}.")
    buffer_k, identity_mode, alpha = check_test_arguments(buffer_k, identity_mode, alpha)
    (n, d_a), d_b = hidden_a.shape, hidden_b.shape[1]
    if n < 2:
        raise InvalidArgumentError(f"SeedPrint needs at least 2 samples for Kendall tau, got {n}.")
    a = _finite_features(hidden_a.detach().float().cpu(), "hidden_a")
    b = _finite_features(hidden_b.detach().float().cpu(), "hidden_b")
    k_a, k_b = min(buffer_k, d_a), min(buffer_k, d_b)  # each model's own bottom-k, clipped to its own width
    bottom_a = identity_dims(a, k_a)
    if identity_mode == "coset":
        dims = sorted(set(bottom_a) & set(identity_dims(b, k_b)))
    else:
        dims = sorted(set(bottom_a))
        _base_dims_within(dims, d_a, d_b)
    k = len(dims)
    caveats = []
    if k >= MIN_DIMS:
        tau = per_dim_kendall(_normed(a, dims), _normed(b, dims))
        tau_mean = float(tau.mean())
        if not math.isfinite(tau_mean):
            constant = [dim for dim, t in zip(dims, tau.tolist()) if not math.isfinite(t)]
            caveats.append(f"Kendall tau is undefined in {len(constant)} of the {k} identity dims (dims {_first(constant)}: "
                           f"a softmax-normalised feature is constant over the {n} samples), so the mean tau and the "
                           "test are undefined: no evidence either way.")
    else:
        tau, tau_mean = torch.full((k,), float("nan"), dtype=torch.float64), float("nan")
        bottom = f"{k_a} of each model" if k_a == k_b else f"{k_a} of A and {k_b} of B"
        hint = (" (identity_mode='coset' compares the dims both models place lowest; try a larger buffer_k)"
                if identity_mode == "coset" and (k_a < d_a or k_b < d_b) else "")
        caveats.append(f"only {k} identity dim{'' if k == 1 else 's'} (of the bottom {bottom}) {'is' if k == 1 else 'are'} "
                       f"shared, and the test needs at least {MIN_DIMS}: the softmax over one dimension is constant, so "
                       f"Kendall tau is undefined: no evidence either way{hint}.")
    z = log_p = p_value = float("nan")
    if math.isfinite(tau_mean):
        z = tau_mean / max(kendall_tau_null_std(n) / math.sqrt(k), 1e-10)
        log_p = math.log(2.0) + float(norm.logsf(z))
        p_value = min(1.0, math.exp(log_p))
    return FingerprintResult(
        p_value=p_value, z=z, tau_mean=tau_mean, n_dims=k, n_samples=n, alpha=alpha, log10_p=log_p / math.log(10.0),
        same_lineage=None if math.isnan(p_value) else p_value < alpha, dims=dims, tau=tau, caveats=caveats,
        settings={"buffer_k": buffer_k, "identity_mode": identity_mode, "temperature": TEMPERATURE, "widths": [d_a, d_b]})


class _RandomInputs(Sequence):
    """``N`` seeded random inputs in batches: token ids, or (embedding mode) placeholder ids plus ``N(μ, σ)``
    embeddings drawn one ``[L, d_model]`` sample at a time, so inputs do not depend on ``batch_size``."""

    def __init__(self, n: int, seq_len: int, batch_size: int, *, mode: str, high: int, seed: int,
                 device: torch.device, d_model: int = 0, mu: float = 0.0, sigma: float = 1.0) -> None:
        self.n, self.seq_len, self.batch_size, self.mode, self.high = n, seq_len, batch_size, mode, high
        self.seed, self.device, self.d_model, self.mu, self.sigma = seed, device, d_model, mu, sigma

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)

    def _batch(self, gen: torch.Generator, size: int) -> TokenBatch:
        tokens = (torch.randint(0, self.high, (size, self.seq_len), generator=gen) if self.mode == "token"
                  else torch.zeros((size, self.seq_len), dtype=torch.long))
        return TokenBatch(tokens, torch.ones_like(tokens, dtype=torch.bool), False).to(self.device)

    def __iter__(self):
        self._gen = torch.Generator().manual_seed(self.seed)
        for start in range(0, self.n, self.batch_size):
            yield self._batch(self._gen, min(self.batch_size, self.n - start))

    def __getitem__(self, i: int) -> TokenBatch:  # random access (type checkers sample one); O(i) for tokens
        if not 0 <= i < len(self):
            raise IndexError(i)
        gen = torch.Generator().manual_seed(self.seed)
        start = i * self.batch_size
        if self.mode == "token" and start:
            torch.randint(0, self.high, (start, self.seq_len), generator=gen)
        return self._batch(gen, min(self.batch_size, self.n - start))

    def embeddings(self, size: int) -> Float[Tensor, "batch pos d_model"]:
        """The next ``size`` samples' embeddings, ``[size, L, d_model]`` float32 (embedding mode, during iteration)."""
        return torch.stack([torch.normal(self.mu, self.sigma, (self.seq_len, self.d_model), generator=self._gen)
                            for _ in range(size)])

    def last_embeddings(self) -> Float[Tensor, "sample d_model"]:
        """Every sample's last-position embedding, ``[N, d_model]``, drawn again exactly as iteration draws them."""
        return torch.cat([self.embeddings(batch.tokens.shape[0])[:, -1] for batch in self])


class _LastFinalState(Reducer[Tensor]):
    """Folds each batch to its last-position final hidden state ``[batch, d_model]`` (float32, CPU)."""

    statistics = ("rows",)  # in sequence order: merging concatenates

    def __init__(self, model: Any, source: _RandomInputs) -> None:
        self.site, self.finish = final_state_site(model)
        self.source, self.dtype = source, next(model.parameters()).dtype
        self.reset()

    def reset(self) -> None:
        self.rows: list[Tensor] = []

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        hooks = []
        if self.source.mode == "embedding":
            emb = self.source.embeddings(batch.tokens.shape[0]).to(batch.tokens.device, self.dtype)
            hooks.append(("hook_embed", lambda act, hook: emb.to(act.dtype)))

        def keep(act: Tensor, hook: Any) -> None:  # clone: a view would keep the whole activation alive
            self.rows.append(self.finish(act[:, -1:, :])[:, 0, :].clone().float().cpu())

        hooks.append((self.site, keep))
        if self.site == "unembed.hook_in":  # unembed the last position only (~15% of SmolLM2's forward)
            hooks.append((self.site, lambda act, hook: act[:, -1:, :]))
        return BatchFold(hooks)

    def result(self) -> Tensor:
        return torch.cat(self.rows, dim=0)


def embedding_stats_at_init(models: Sequence[Any], *, seed: int = DEFAULT_SEED) -> tuple[float, float]:
    """``(μ, σ)`` for embedding mode: mean and unbiased std of ``W_E`` of each model's architecture freshly
    initialized (:func:`sinklens.loading.init.load_at_init`, ``init_seed=seed``), entries pooled."""
    seed = as_seed(seed, what="seed")
    draws: list[Tensor] = []
    for model in {id(m): m for m in models}.values():
        w = load_at_init(model, init_seed=seed).W_E.detach().float().reshape(-1).cpu()
        if not any(torch.equal(w, other) for other in draws):
            draws.append(w)
    w = torch.cat(draws)
    return float(w.mean()), float(w.std())


def final_hidden_states(
    model: Any, *, n_samples: int = DEFAULT_SAMPLES, seq_len: int = DEFAULT_SEQ_LEN,
    input: InputMode = "token", seed: int = DEFAULT_SEED, vocab_limit: int | None = None,
    embedding_stats: tuple[float, float] | None = None, options: RunOptions = RunOptions(),
) -> Float[Tensor, "sample d_model"]:
    """Steps 1–2: the last-position final hidden states on ``n_samples`` random sequences of ``seq_len``
    (no BOS): uniform ids below ``vocab_limit`` (default ``min(32000, d_vocab)``), or ``N(μ, σ)`` vectors
    replacing ``hook_embed`` (``embedding_stats``, default :func:`embedding_stats_at_init`)."""
    options = checked_options(options, "final_hidden_states")
    dims = model_dims(model)
    n_samples = positive_int(n_samples, what="n_samples", minimum=2)
    seq_len = positive_int(seq_len, what="seq_len")
    seed = as_seed(seed, what="seed")
    if seq_len > dims.n_ctx:
        raise InvalidArgumentError(f"seq_len={seq_len} exceeds the model's context window n_ctx={dims.n_ctx}.")
    input = choice(input, ("token", "embedding"), what="input")  # type: ignore[assignment]
    high = min(TOKEN_VOCAB, dims.d_vocab) if vocab_limit is None else positive_int(vocab_limit, what="vocab_limit")
    if high > dims.d_vocab:
        raise InvalidArgumentError(f"vocab_limit={high} exceeds the model's vocabulary d_vocab={dims.d_vocab}.")
    mu, sigma = 0.0, 1.0  # unused in token mode
    if input == "embedding":
        mu, sigma = embedding_stats_at_init([model], seed=seed) if embedding_stats is None else (
            finite_number(x, what=f"embedding_stats[{i}]", low=0.0 if i else None) for i, x in enumerate(embedding_stats))
    source = _RandomInputs(n_samples, seq_len, options.batch_size, mode=input, high=high, seed=seed,
                           device=model_device(model), d_model=dims.d_model, mu=mu, sigma=sigma)
    (hidden,) = stream(model, source, [_LastFinalState(model, source)], options=options)  # type: ignore[arg-type]
    return hidden


def fingerprint(
    model_a: Any, model_b: Any, *, n_samples: int = DEFAULT_SAMPLES, seq_len: int | None = None,
    input: InputMode = "token", buffer_k: int = DEFAULT_BUFFER_K,
    identity_mode: IdentityMode = "coset", alpha: float = DEFAULT_ALPHA, seed: int = DEFAULT_SEED,
    options: RunOptions = RunOptions(desc="SeedPrint"),
) -> FingerprintResult:
    """SeedPrint lineage test between two models or :func:`sinklens.load_model` specs (module docstring);
    ``seq_len`` defaults to ``min(1024, n_ctx_a, n_ctx_b)``; ``input="embedding"`` needs equal hidden sizes
    and adds ``embedding_mu``, ``embedding_sigma`` and ``shared_input_z`` to ``settings``.

    Examples:
        >>> from sinklens.testing import QUIET, tiny_model
        >>> a = tiny_model(seed=1)
        >>> fingerprint(a, a, n_samples=64, seq_len=8, options=QUIET).same_lineage
        True
    """
    buffer_k, identity_mode, alpha = check_test_arguments(buffer_k, identity_mode, alpha)
    n_samples = positive_int(n_samples, what="n_samples", minimum=2)
    seed = as_seed(seed, what="seed")
    input = choice(input, ("token", "embedding"), what="input")  # type: ignore[assignment]
    model_a, model_b = (load_model(m, check_patterns=False) if isinstance(m, str) else m for m in (model_a, model_b))
    da, db = model_dims(model_a), model_dims(model_b)
    if input == "embedding" and da.d_model != db.d_model:
        raise InvalidArgumentError(
            f"input='embedding' feeds both models the same embeddings and needs equal hidden sizes, got "
            f"d_model={da.d_model} (A) and d_model={db.d_model} (B); use input='token' (--input token, the default).")
    seq_len = min(DEFAULT_SEQ_LEN, da.n_ctx, db.n_ctx) if seq_len is None else positive_int(seq_len, what="seq_len")
    stats = embedding_stats_at_init([model_a, model_b], seed=seed) if input == "embedding" else None
    vocab = min(TOKEN_VOCAB, da.d_vocab, db.d_vocab)
    common = dict(n_samples=n_samples, seq_len=seq_len, input=input, seed=seed, vocab_limit=vocab,
                  embedding_stats=stats)
    hidden_a = _finite_features(
        final_hidden_states(model_a, **common, options=options.replace(desc=f"{options.desc} A")), "model A's final states")
    if identity_mode == "base" and da.d_model > db.d_model:  # refused before B runs (seedprint_test would, after)
        _base_dims_within(sorted(identity_dims(hidden_a, min(buffer_k, da.d_model))), da.d_model, db.d_model)
    hidden_b = _finite_features(
        final_hidden_states(model_b, **common, options=options.replace(desc=f"{options.desc} B")), "model B's final states")
    result = seedprint_test(hidden_a, hidden_b, buffer_k=buffer_k, identity_mode=identity_mode, alpha=alpha)
    result.settings.update({"input": input, "seq_len": seq_len, "seed": seed, "vocab_limit": vocab,
                            **({"embedding_mu": stats[0], "embedding_sigma": stats[1]} if stats else {})})
    if stats is not None and not result.undefined:
        inputs = _RandomInputs(n_samples, seq_len, options.batch_size, mode="embedding", high=vocab, seed=seed,
                               device=torch.device("cpu"), d_model=da.d_model, mu=stats[0], sigma=stats[1])
        z_input = shared_input_z(hidden_a, hidden_b, inputs.last_embeddings(), result.dims)
        result.settings["shared_input_z"] = z_input
        if z_input > (limit := max_shared_input_z(alpha)):
            result.caveats.append(
                f"both models' final states follow the shared random input embeddings, which alone give unrelated "
                f"models z = {z_input:.3g} (limit {limit:.2f}): no evidence of lineage; use input='token' (--input token).")
    if input == "token" and (shared := shared_last_token_share(n_samples, vocab)) > MAX_SHARED_LAST_TOKEN:
        result.caveats.append(
            f"the {n_samples} random sequences end in one of only {vocab} token ids, so about {shared:.0%} of them "
            "share their last token: dependent samples make the p-value too small (at most "
            f"{samples_for_share(MAX_SHARED_LAST_TOKEN, vocab)} samples keep that share under {MAX_SHARED_LAST_TOKEN:.0%}).")
    return result


def shared_input_z(
    hidden_a: Float[Tensor, "sample dim"], hidden_b: Float[Tensor, "sample dim"],
    inputs: Float[Tensor, "sample dim"], dims: list[int],
) -> float:
    """The ``z`` the shared input alone would give two unrelated models (embedding mode; sinklens' own check):
    with ``ρ = sin(π τ / 2)`` from each model's mean Kendall τ against the inputs, ``τ = (2/π) arcsin(ρ_A ρ_B)``,
    divided by ``σ_τ(N) / sqrt(k)``. NaN with fewer than 2 dims."""
    if len(dims) < MIN_DIMS:
        return float("nan")
    rho_a, rho_b = (math.sin(math.pi / 2 * float(per_dim_kendall(_normed(h, dims), _normed(inputs, dims)).mean()))
                    for h in (hidden_a, hidden_b))
    tau = 2.0 / math.pi * math.asin(rho_a * rho_b)
    return tau / (kendall_tau_null_std(hidden_a.shape[0]) / math.sqrt(len(dims)))
