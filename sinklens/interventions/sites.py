"""Where an intervention's ``site`` is edited, so that it means the same on every TransformerLens version:
the 4.x BERT bridge fires ``hook_resid_mid`` after the MLP, so edits go to ``ln1.hook_in`` there (:func:`edit_site`).
"""

from __future__ import annotations

from typing import Any

from sinklens.hooks import RESID_MID, hook_name
from sinklens.residual_units import post_ln_reason

#: The hook of a post-LN bridge block that carries ``resid_pre + attention write`` (3.x's ``hook_resid_mid``).
POST_LN_MID = "ln1.hook_in"


def edit_site(model: Any, site: str) -> str:
    """The per-layer hook site at which an edit of ``site`` means what it names: ``"hook_resid_mid"`` on a
    post-LN 4.x bridge becomes ``"ln1.hook_in"``; anything else is returned as given.

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
