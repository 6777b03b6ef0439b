"""User code written against the flat controller layout still imports for one release: the old
path is the new module (one object), with one DeprecationWarning naming the new path."""

import subprocess
import sys

from miles_like.moved_modules import MOVED


def test_old_paths_are_the_new_modules_with_a_warning():
    code = (
        "import importlib, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "import miles_like\n"
        "from miles_like.moved_modules import MOVED\n"
        "for old, new in MOVED.items():\n"
        "    try:\n"
        "        importlib.import_module(old)\n"
        "    except DeprecationWarning as w:\n"
        "        assert new in str(w), w\n"
        "    else:\n"
        "        raise AssertionError(f'{old}: no warning')\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "for old, new in MOVED.items():\n"
        "    a, b = importlib.import_module(old), importlib.import_module(new)\n"
        "    assert a is b and b.__spec__.name == new, (old, b.__spec__.name)\n"
        "from miles_like.rollout_context import RolloutContext\n"
        "from miles_like.rollouts.context import RolloutContext as R\n"
        "assert RolloutContext is R\n"
        "print('ok', len(MOVED))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", str(len(MOVED))]
