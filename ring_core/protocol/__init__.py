"""The ring protocol: its device steps (``steps``, ``lanes``) and its host side (``control``)."""
