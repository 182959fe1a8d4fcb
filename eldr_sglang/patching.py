"""Apply, check and revert the ELDR patch series on an installed SGLang (or a source tree).

The series (patches/sglang-<version>/series) is a list of format-patch files whose paths
are relative to the directory holding the `sglang` package (site-packages for an install).
Each patch is in one of three states, decided by dry runs: `applied` (it reverses
cleanly), `unapplied` (it applies cleanly) or `conflict` (neither: another version, or a
tree edited by hand). Apply and revert are idempotent and all-or-nothing: a failure rolls
back what the same call changed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_SGLANG = "0.5.23"


class PatchError(RuntimeError):
    """The series cannot be applied, checked or reverted; the message says why."""


@dataclass
class PatchState:
    name: str
    state: str  # 'applied' | 'unapplied' | 'conflict'
    detail: str = ""


def default_series_dir(version: str = SUPPORTED_SGLANG) -> Path:
    env = os.environ.get("ELDR_PATCHES_DIR")
    if env:
        return Path(env) / f"sglang-{version}"
    return Path(__file__).resolve().parent.parent / "patches" / f"sglang-{version}"


def read_series(series_dir: Path) -> list[Path]:
    series = series_dir / "series"
    if not series.is_file():
        raise PatchError(f"no patch series at {series} (set ELDR_PATCHES_DIR or pass --series)")
    names = [ln.strip() for ln in series.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    paths = [series_dir / n for n in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise PatchError(f"series lists missing patch files: {', '.join(missing)}")
    if not paths:
        raise PatchError(f"{series} lists no patches")
    return paths


def touched_files(patch: Path) -> list[str]:
    """Paths (relative to the tree root) a patch modifies."""
    out = []
    for ln in patch.read_text().splitlines():
        m = re.match(r"^\+\+\+ b/(\S+)", ln)
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return out


def locate_sglang(target: str | os.PathLike | None = None) -> tuple[Path, str]:
    """(tree root holding sglang/, sglang version) of `target` or of the installed package."""
    if target is not None:
        root = Path(target)
        if not (root / "sglang" / "__init__.py").is_file():
            raise PatchError(f"{root} holds no sglang package (no sglang/__init__.py)")
        for name in ("_version.py", "version.py"):  # wheels generate _version.py
            vfile = root / "sglang" / name
            m = vfile.is_file() and re.search(r"^__version__\s*=.*?['\"]([^'\"]+)['\"]", vfile.read_text(), re.M)
            if m:
                return root, m.group(1)
        raise PatchError(f"cannot read the sglang version under {root / 'sglang'}")
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(f"sglang is not installed (pip install 'sglang=={SUPPORTED_SGLANG}')")
    pkg = Path(list(spec.submodule_search_locations)[0])
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return locate_sglang(pkg.parent)
    return pkg.parent, version


def _require_version(version: str, root: Path) -> None:
    if version != SUPPORTED_SGLANG:
        raise PatchError(
            f"sglang {version} found at {root}; the ELDR patch series supports sglang "
            f"{SUPPORTED_SGLANG} only (pip install 'sglang=={SUPPORTED_SGLANG}')"
        )


class _Tool:
    """`git apply` (preferred) or GNU `patch`, run with the tree root as working directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.git = shutil.which("git")
        self.patch = shutil.which("patch")
        if not self.git and not self.patch:
            raise PatchError("neither git nor patch is installed; one of them is needed to apply the series")

    def _run(self, patch: Path, reverse: bool, dry: bool) -> tuple[bool, str]:
        if self.git:
            cmd = [self.git, "apply", "-p1", "--whitespace=nowarn"]
            cmd += ["--reverse"] if reverse else []
            cmd += ["--check"] if dry else []
            cmd += [str(patch)]
            # never let git discover a repository above the tree (it would re-root the paths)
            env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(self.root.resolve().parent))
        else:
            cmd = [self.patch, "-p1", "-f", "-s", "--no-backup-if-mismatch", "-i", str(patch)]
            cmd += ["-R"] if reverse else ["-N"]
            cmd += ["--dry-run"] if dry else []
            env = None
        p = subprocess.run(cmd, cwd=self.root, env=env, capture_output=True, text=True)
        return p.returncode == 0, (p.stderr or p.stdout).strip()

    def state(self, patch: Path) -> PatchState:
        fwd, why = self._run(patch, reverse=False, dry=True)
        if fwd:
            return PatchState(patch.name, "unapplied")
        rev, _ = self._run(patch, reverse=True, dry=True)
        if rev:
            return PatchState(patch.name, "applied")
        return PatchState(patch.name, "conflict", why.splitlines()[0] if why else "does not apply")

    def apply(self, patch: Path, reverse: bool = False) -> None:
        ok, why = self._run(patch, reverse=reverse, dry=False)
        if not ok:
            raise PatchError(f"{'reverting' if reverse else 'applying'} {patch.name} failed: {why}")


def _prepare(target, series_dir) -> tuple[Path, list[Path], _Tool]:
    root, version = locate_sglang(target)
    _require_version(version, root)
    patches = read_series(Path(series_dir) if series_dir else default_series_dir())
    return root, patches, _Tool(root)


def check(target=None, series_dir=None) -> tuple[Path, list[PatchState]]:
    root, patches, tool = _prepare(target, series_dir)
    return root, [tool.state(p) for p in patches]


def apply(target=None, series_dir=None) -> tuple[Path, list[str]]:
    """Apply every unapplied patch in order; returns (root, names applied now)."""
    root, patches, tool = _prepare(target, series_dir)
    states = [tool.state(p) for p in patches]
    bad = [s for s in states if s.state == "conflict"]
    if bad:
        raise PatchError(
            f"{bad[0].name} neither applies nor reverts cleanly in {root} ({bad[0].detail}); "
            "is this a modified sglang? Reinstall sglang==" + SUPPORTED_SGLANG
        )
    done: list[Path] = []
    try:
        for p, s in zip(patches, states):
            if s.state == "unapplied":
                tool.apply(p)
                done.append(p)
    except PatchError:
        for p in reversed(done):
            tool.apply(p, reverse=True)
        raise
    return root, [p.name for p in done]


def revert(target=None, series_dir=None) -> tuple[Path, list[str]]:
    """Revert every applied patch, last first; returns (root, names reverted now)."""
    root, patches, tool = _prepare(target, series_dir)
    states = [tool.state(p) for p in patches]
    bad = [s for s in states if s.state == "conflict"]
    if bad:
        raise PatchError(f"{bad[0].name} neither applies nor reverts cleanly in {root} ({bad[0].detail})")
    done: list[Path] = []
    try:
        for p, s in reversed(list(zip(patches, states))):
            if s.state == "applied":
                tool.apply(p, reverse=True)
                done.append(p)
    except PatchError:
        for p in reversed(done):
            tool.apply(p)
        raise
    return root, [p.name for p in done]
