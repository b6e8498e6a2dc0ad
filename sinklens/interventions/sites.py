"""Where an intervention's per-layer ``site`` is edited, so that it means the same on every TransformerLens version.

``blocks.{l}.hook_resid_mid`` names the residual right after the attention write, ``resid_pre + write``: the
input of the MLP's branch. On a post-LN block (BERT, :func:`~sinklens.residual_units.post_ln_reason`) the
MLP reads ``ln1(resid_pre + write)``; TransformerLens 3.x's ``HookedEncoder`` fires ``hook_resid_mid`` with
``resid_pre + write``, before ``ln1``, so an edit there reaches ``ln1``, the MLP and everything after. The 4.x
bridge fires ``hook_resid_mid`` as ``ln2.hook_in``: ``ln1``'s output *plus the MLP output*, after the MLP, so
an edit there never reaches the MLP (a ``clamp_dims`` at ``hook_resid_mid`` left ``mlp.hook_in`` unchanged).
The bridge's ``ln1.hook_in`` carries exactly ``resid_pre + write`` (3.x's ``hook_resid_mid``) and an edit there
flows through ``ln1`` to the MLP, so the edit factories (:func:`~sinklens.interventions.amplify`,
:func:`~sinklens.interventions.calibrate`, :func:`~sinklens.interventions.clamp_dims`,
:func:`~sinklens.interventions.transplant_dims`) make a ``hook_resid_mid`` edit there (:func:`edit_site`).
:func:`~sinklens.interventions.patch_sink` keeps ``hook_resid_mid``: patching a whole position is the same
at either hook (``ln1``, the MLP and ``ln2`` act on one position at a time).
"""

from __future__ import annotations

from typing import Any

from sinklens.hooks import RESID_MID, hook_name
from sinklens.residual_units import post_ln_reason

#: The hook of a post-LN bridge block that carries ``resid_pre + attention write`` (3.x's ``hook_resid_mid``).
POST_LN_MID = "ln1.hook_in"


def edit_site(model: Any, site: str) -> str:
    """The per-layer hook site at which an edit of ``site`` means what ``site`` names on ``model``.

    ``"hook_resid_mid"`` on a post-LN TransformerLens 4.x bridge (BERT) becomes ``"ln1.hook_in"`` (see the module
    docstring); every other site, and ``"hook_resid_mid"`` on every other model (3.x's ``HookedEncoder``
    included), is returned as given.

    Examples:
        >>> from sinklens.testing.zoo import zoo_model
        >>> edit_site(zoo_model("llama"), "hook_resid_mid")
        'hook_resid_mid'
    """
    if site != RESID_MID or post_ln_reason(model) is None:
        return site
    if getattr(model, "original_model", None) is None or hook_name(0, POST_LN_MID) not in model.hook_dict:
        return site  # 3.x's HookedEncoder: its hook_resid_mid is already before ln1
    return POST_LN_MID
