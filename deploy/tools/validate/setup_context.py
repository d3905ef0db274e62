"""The Dockerfile's `RUN ./dmuon setup ...` step, run in the context it has
(deploy/validate.sh, step 5, through flags.py).

The build stage copies only a few files (today: `dmuon` alone) before it runs
`./dmuon setup --no-venv`, so that the package layer survives source changes.
If `./dmuon` reads another file at top level (as it once sourced
deploy/image/lib.sh), that step fails in the image build, which nothing here
runs. This check copies exactly what the Dockerfile's COPY instructions of
that stage bring before the RUN into an empty directory and runs there

    bash dmuon help                 the top-level code (must exit 0)
    bash dmuon setup --no-such-arg  setup's argument parsing (must refuse the
                                    argument by name: nothing is installed)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path, PurePosixPath

SETUP_RUN = re.compile(r"^RUN\s+(?:\S+=\S+\s+)*\./dmuon\s+setup\b")
BAD_ARG = "--no-such-arg"


def copies_before_setup(instructions: list[str]) -> tuple[list[tuple[str, str]], str] | None:
    """(source, destination) of the COPY instructions of the stage that runs
    `./dmuon setup`, those before that RUN, and the WORKDIR there; None when
    no stage runs it."""
    copies: list[tuple[str, str]] = []
    workdir = "/"
    for ins in instructions:
        op = ins.split(None, 1)[0].upper()
        rest = ins[len(op):].strip()
        if op == "FROM":
            copies, workdir = [], "/"
        elif op == "WORKDIR":
            workdir = str(PurePosixPath(workdir) / rest)
        elif op in ("COPY", "ADD"):
            parts = rest.split()
            if any(p.startswith("--from") for p in parts):
                continue
            words = [p for p in parts if not p.startswith("--")]
            copies += [(src, words[-1]) for src in words[:-1]]
        elif op == "RUN" and SETUP_RUN.match(ins):
            return copies, workdir
    return None


def _place(root: Path, ctx: Path, src: str, dest: str, workdir: str) -> None:
    target = PurePosixPath(workdir) / dest
    inside = ctx / str(target).lstrip("/")
    if dest.endswith("/"):
        inside = inside / Path(src).name
    inside.parent.mkdir(parents=True, exist_ok=True)
    if (root / src).is_dir():
        shutil.copytree(root / src, inside, dirs_exist_ok=True)
    else:
        shutil.copy2(root / src, inside)


def check_setup_context(root: Path, instructions: list[str]) -> tuple[list[str], str]:
    """(problems, what was checked) for the setup step's build context."""
    found = copies_before_setup(instructions)
    if found is None:
        return [], "no RUN ./dmuon setup step"
    copies, workdir = found
    with tempfile.TemporaryDirectory(prefix="dmuon-setup-ctx.") as tmp:
        ctx = Path(tmp)
        for src, dest in copies:
            if re.search(r"[*?$]", src) or not (root / src).exists():
                return [f"cannot copy {src} for the setup step (a pattern or missing)"], ""
            _place(root, ctx, src, dest, workdir)
        cwd = ctx / workdir.lstrip("/")
        if not (cwd / "dmuon").is_file():
            return [f"the setup step runs ./dmuon in {workdir}, and no COPY puts dmuon there"], ""
        problems = []
        for argv, want_rc, want_text in ((["help"], 0, "./dmuon setup"),
                                         (["setup", BAD_ARG], 1, f"unknown setup argument '{BAD_ARG}'")):
            try:
                r = subprocess.run(["bash", "dmuon", *argv], cwd=cwd, capture_output=True, text=True,
                                   timeout=30, check=False)
            except subprocess.TimeoutExpired:
                problems.append(f"`./dmuon {' '.join(argv)}` took over 30 s in the setup step's context")
                continue
            out = r.stdout + r.stderr
            if r.returncode != want_rc or want_text not in out:
                problems.append(f"`./dmuon {' '.join(argv)}` with only "
                                f"{', '.join(s for s, _ in copies)} copied (as the Dockerfile does before "
                                f"RUN ./dmuon setup): exit {r.returncode}, expected {want_rc} "
                                f"and '{want_text}': {out.strip()[-300:]}")
    shown = ", ".join(s for s, _ in copies)
    return problems, f"./dmuon runs (help, setup's arguments) with only {shown} copied, as before RUN ./dmuon setup"
