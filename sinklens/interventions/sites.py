"""Where an intervention's per-layer ``site`` is edited, so that it means the same on every TransformerLens version.

``blocks.{l}.hook_resid_mid`` names the residual right after the attention write, ``resid_pre + write``, which
the MLP's branch reads. On a post-LN block (BERT) 3.x's ``HookedEncoder`` fires it there, but the 4.x bridge
fires it as ``ln2.hook_in``, after the MLP, where an edit never reaches the MLP; the bridge's ``ln1.hook_in``
carries ``resid_pre + write``, so the edit factories edit there (:func:`edit_site`).
:func:`~sinklens.interventions.patch_sink` keeps ``hook_resid_mid``: patching a whole position is the same at
either hook.
"""

from __future__ import annotations

from typing import Any

from sinklens.hooks import RESID_MID, hook_name
from sinklens.residual_units import post_ln_reason

#: The hook of a post-LN bridge block that carries ``resid_pre + attention write`` (3.x's ``hook_resid_mid``).
POST_LN_MID = "ln1.hook_in"


def edit_site(model: Any, site: str) -> str:
    """The per-layer hook site at which an edit of ``site`` means what ``site`` names on ``model``.

    ``"hook_resid_mid"`` on a post-LN 4.x bridge (BERT) becomes ``"ln1.hook_in"``; anything else is returned as given.

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
