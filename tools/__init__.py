"""A checkout's diagnostics, QA harnesses and simulations: not part of the installed package.

Each tool runs from the repository root as `python -m tools.NAME --help` (tools/README.md lists them).
Tools import `conveyor`; nothing in `conveyor` imports them (tests/test_architecture.py checks).
"""
