"""The user-facing tools (``zero-recipes ...``): planner, probe, linter CLI, export, cp.

Recipes never import this package; these tools talk to a recipe only through its command line
(``--describe``, and launched runs).
"""
