"""Sub-commands of the ``sinklens`` CLI, one module each."""

from __future__ import annotations

import re


def plain_help(docstring: str | None) -> str:
    """A command module's reStructuredText docstring as terminal help: ``code`` and roles unquoted.

    Examples:
        >>> print(plain_help("``sinklens train``: see :mod:`sinklens.train`.\\n\\nExamples::\\n\\n    sinklens train"))
        sinklens train: see sinklens.train.
        <BLANKLINE>
        Examples:
        <BLANKLINE>
            sinklens train
    """
    text = re.sub(r":(?:mod|func|class|meth|data|attr):`~?([^`]+)`", r"\1", docstring or "")
    text = text.replace("``", "")
    return re.sub(r"::$", ":", text, flags=re.MULTILINE)
