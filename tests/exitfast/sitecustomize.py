"""Imported by every Python process the test suite starts (tests/conftest.py puts this folder
first on PYTHONPATH, and jobs, srun tasks and torchrun workers inherit it), but notebook kernels
and what their cells start, which conftest.py starts without it.

It changes when the garbage collector looks at the objects torch creates as it is imported, and
nothing else:
- While `import torch` runs, the collector is off; once it is done, those objects (torch's
  modules, its operator registrations: about a million) are frozen (`gc.freeze`), and the
  collector is on again, as before. Its passes during the run then skip them, instead of
  walking them all at every full pass: 0.2 to 0.4 CPU-seconds less per torch process.
- At exit the heap is frozen again, so that the interpreter's last pass skips what torch leaves
  alive: 0.6 to 0.8 CPU-seconds less per torch process.
On a 2-core machine that adds up over the thousand-odd processes of CI (tests/README.md has the
figures). It changes nothing a test checks: what is frozen after the import is what torch keeps
for the life of the process anyway, the exit freeze runs after every other exit handler and the
lessons end their process groups themselves; the suite passes the same with
COURSE_TEST_EXITFAST=0, which leaves this file out. Lesson code and students' runs do not load it.
"""

import atexit
import gc
import sys


class _FreezeAfterTorchImport:
    """A finder consulted first for every import: for the top-level ``torch`` only, it hands
    back the spec the other finders give, with the module's execution wrapped as above."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once: the wrapper below must not see torch again
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            if not gc.isenabled():  # the program turned it off itself: leave that alone
                return run(module)
            gc.disable()
            try:
                run(module)
                gc.freeze()
            finally:
                gc.enable()

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _FreezeAfterTorchImport())
atexit.register(gc.freeze)
