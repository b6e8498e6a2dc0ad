"""Where an intervention's ``site`` is edited, so that it means the same on every TransformerLens version."""

from __future__ import annotations

from typing import Any

from sinklens.hooks import RESID_MID, hook_name
from sinklens.residual_units import post_ln_reason

#: The hook of a post-LN bridge block that carries ``resid_pre + attention write`` (3.x's ``hook_resid_mid``).
POST_LN_MID = "ln1.hook_in"


def edit_site(model: Any, site: str) -> str:
    """``site``, except ``"hook_resid_mid"`` on a post-LN 4.x bridge (fired after the MLP there): ``"ln1.hook_in"``."""
    if site != RESID_MID or post_ln_reason(model) is None:
        return site
    if getattr(model, "original_model", None) is None or hook_name(0, POST_LN_MID) not in model.hook_dict:
        return site  # 3.x's HookedEncoder: its hook_resid_mid is already before ln1
    return POST_LN_MID
