"""gdn2: pretraining Gated DeltaNet-2 language models. ``python -m gdn2 --help`` lists the commands.

The checkout's top-level ``configs/``, ``data_prep/`` and ``eval/`` folders are the subpackages
``gdn2.configs``, ``gdn2.data_prep`` and ``gdn2.eval``: ``pip install`` maps them into the package. In a
checkout that is not installed (``python pretrain/main.py`` puts the checkout on ``sys.path``), the
package finds them beside its own folder instead.
"""

from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "data_prep" / "__init__.py").is_file() and not (_checkout / "gdn2" / "data_prep").exists():
    __path__.append(str(_checkout))  # type: ignore[name-defined]  # noqa: F821 - a package's own __path__
del _Path, _checkout
