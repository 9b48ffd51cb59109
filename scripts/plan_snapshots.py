"""Every shipped recipe's ``plan --json``, written to a folder or compared with one written
before: the check that a change meant to leave behaviour alone (a restructure) plans every
recipe to the byte as before.

    python scripts/plan_snapshots.py --write /tmp/plans-before   # before the change
    python scripts/plan_snapshots.py --compare /tmp/plans-before # after it: exit 1 on a difference
    python scripts/plan_snapshots.py --compare /tmp/plans-before --only 'llama3_8b_*'  # a few

Each recipe is planned as ``python -m upipe_dtensor.plan --config RECIPE --json`` plans it (the
same function, in this process): on h100-sxm with 80 GiB, or h200 with 140 GiB where the
recipe's name says h200; the context-extension recipes on a stand-in Llama-3.1-8B folder (its
config.json, the shipped tokenizer, no weights: the planner reads none). About 10 minutes on 2
cores.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from harness import llama_31_8b_folder  # noqa: E402

from upipe_dtensor.planning.cli import main as plan_main  # noqa: E402


def recipes(only: str = "*") -> list[Path]:
    """Every shipped recipe (recipes/, its baselines/ and multinode/) whose path under recipes/
    matches the glob ``only``."""
    found = sorted((REPO / "recipes").rglob("*.toml"))
    return [r for r in found if fnmatch.fnmatch(str(r.relative_to(REPO / "recipes")), only)]


def plan_json(recipe: Path, stand_in: str) -> str:
    """What ``plan --config RECIPE --json`` prints for ``recipe`` (exit code 3, "does not fit",
    is an answer too)."""
    argv = ["--config", str(recipe), "--json"]
    if "h200" in recipe.name:
        argv += ["--gpu", "h200"]
    if "extend" in recipe.name:
        argv += ["--model.hf_assets_path", stand_in]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = plan_main(argv)
    if code not in (0, 3):
        raise SystemExit(f"{recipe.relative_to(REPO)}: plan exited {code}")
    return printed.getvalue()


_CHECKOUT = re.compile(r'("config_file": ")[^"]*?(/recipes/)')
_STAND_IN = re.compile(r"[^\s\"']*upipe-plan-snapshots[^/\s\"']*/Llama-3\.1-8B")


def _anywhere(text: str) -> str:
    """``text`` with the checkout's folder left out of the recipe's path and the stand-in HF
    folder's path left out, so that plans made in two checkouts (before and after a change, in
    two worktrees, at once) compare by what they plan."""
    return _STAND_IN.sub("<stand-in>", _CHECKOUT.sub(r"\1<checkout>\2", text))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, metavar="DIR", help="write each recipe's plan here")
    mode.add_argument("--compare", type=Path, metavar="DIR", help="compare with plans written")
    parser.add_argument(
        "--only", default="*", metavar="GLOB", help="the recipes whose path under recipes/ matches"
    )
    args = parser.parse_args()
    differ = []
    # A folder of this run's own (``_anywhere`` leaves its path out of what is compared).
    folder = Path(tempfile.mkdtemp(prefix="upipe-plan-snapshots-")) / "Llama-3.1-8B"
    stand_in = llama_31_8b_folder(folder)
    try:
        for recipe in recipes(args.only):
            name = str(recipe.relative_to(REPO / "recipes")).replace("/", "__") + ".json"
            text = _anywhere(plan_json(recipe, stand_in))
            if args.write:
                args.write.mkdir(parents=True, exist_ok=True)
                (args.write / name).write_text(text)
                print(f"wrote {name}", flush=True)
                continue
            before = _anywhere((args.compare / name).read_text())
            same = before == text
            print(f"{'same' if same else 'DIFFERS'}  {recipe.relative_to(REPO)}", flush=True)
            if not same:
                differ.append(recipe)
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)
    if differ:
        print(f"{len(differ)} of {len(recipes(args.only))} plans differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
