"""Runs several example scripts one after another in this one process, each as ``python
examples/<script> ARGS`` would (``__main__``, its own ``sys.argv``), and prints, as JSON, how
each ended: whether it failed, how long it took, and what it wrote to stderr (an uncaught
exception's traceback included). Used where the tests need each script to *fail* in a way a
user sees, and one import of transformers serves them all.

Usage: ``python run_each_failing.py '[["run_clm.py", ["--arg", ...]], ...]'`` (cwd: where the
scripts' relative paths point).
"""

import contextlib
import io
import json
import runpy
import sys
import time
import traceback
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

results = {}
for script, args in json.loads(sys.argv[1]):
    sys.argv = [str(EXAMPLES / script), *args]
    err = io.StringIO()
    start = time.perf_counter()
    code = 0
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(EXAMPLES / script), run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # as the interpreter would: the traceback on stderr, exit status 1
            traceback.print_exc()
            code = 1
    results[script] = {"failed": code != 0, "seconds": time.perf_counter() - start, "stderr": err.getvalue()}
print(json.dumps(results))
