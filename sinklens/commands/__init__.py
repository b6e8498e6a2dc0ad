"""Sub-commands of the ``sinklens`` CLI, one module each."""
