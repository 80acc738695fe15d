"""The test suite: a package, so shared code is imported as ``tests.support.x`` with the
project root on ``sys.path`` (``python -m pytest`` from the root; pytest's default
``prepend`` import mode also inserts the first directory above the packages)."""
