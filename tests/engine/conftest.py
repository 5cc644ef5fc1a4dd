"""The engine tests' real vLLM is the ``engine`` fixture of tests/conftest.py (one per session, shared with the
Engine page's browser test)."""
