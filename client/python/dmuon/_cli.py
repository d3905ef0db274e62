"""The wheel's console scripts `dmuond` and `dmuonctl` (entry_points.txt).

Each replaces this Python process with the binary of the same name that the
package ships in dmuon/bin/ (os.execv: same pid, same stdio, the command
line passed through unchanged, the binary's own exit status), so
`dmuond --listen=0.0.0.0:50051` from a venv behaves like the binary itself.

The binary is looked for inside this package (bin/NAME, as the wheel ships it,
its shared libraries in ../dmuon.libs), then in the Bazel output of the
source checkout this package sits in (bazel-bin/daemon/NAME). Never on $PATH,
where the first `dmuond` is usually this very script, and not $DMUON_DMUOND
either: that names the daemon `server="auto"` starts, while these scripts
always run the package's own binaries.
"""

import os
import signal
import sys

from . import _native


def binary(name):
    """The path of the bundled (or Bazel-built) executable `name`."""
    tried = [os.path.join(_native._package_dir(), "bin", name)]
    root = _native.checkout_root()
    if root:
        tried.append(os.path.join(root, "bazel-bin", "daemon", name))
    for path in tried:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        f"{name}: the dmuon package has no {name} binary (looked at "
        + ", ".join(tried)
        + "); reinstall the wheel (./dmuon wheel), or in a source checkout "
        f"build it with `bazel build //server:{name}`"
    )


def _exec(name):
    try:
        path = binary(name)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 127
    # Python starts with SIGPIPE and SIGXFSZ ignored, and an ignored signal
    # stays ignored across exec: give the binary the dispositions it would
    # get from a shell (so `dmuonctl status | head` ends quietly).
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(path, [path, *sys.argv[1:]])
    except OSError as e:  # not executable, wrong architecture, ...
        print(f"{name}: cannot run {path}: {e}", file=sys.stderr)
        return 126


def dmuond():
    """Console script `dmuond`: the optimizer daemon (see `dmuond --help`)."""
    return _exec("dmuond")


def dmuonctl():
    """Console script `dmuonctl`: the operator CLI (see `dmuonctl --help`)."""
    return _exec("dmuonctl")
