"""Long runs that take turns: a line per lab (``queue``) and the arena lab built on it (``arena``)."""
