"""Time verl-dmd-prepare and the decoded validation on the tiny real pipelines of the four families (CPU).

Per family: build the tiny pipeline (`verl_dmd.testing.pipelines`), prepare `--prompts` prompts
(plus the negative and 2 validation prompts; `--pairs` adds teacher pairs), then a `verl-dmd --local`
run of 2 student steps with validation at both (2 prompts, teacher 2 Euler steps, student_ema at 1 and
4 steps). Reports prepare's wall time and rate, the first validation (teacher sampled and decoded,
then the students) and the second (the teacher reused), read from the run's own log lines. The tiny
models make these start-up and overhead times, not model compute: they say what prepare and validation
cost around the models, not what they cost on a real pipeline.

    python scripts/bench_prepare.py [--prompts 64] [--pairs] [--out bench_prepare.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--pairs", action="store_true")
    parser.add_argument("--out", default="bench_prepare.json")
    args = parser.parse_args()

    from prepare_scenarios import VALIDATION_PROMPTS, prepare_overrides, recipe, train_overrides, write_lines

    from verl_dmd import main as train_main
    from verl_dmd import prepare_main
    from verl_dmd.main import compose_config
    from verl_dmd.testing.pipelines import FAMILIES, build_pipeline

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        prompts = write_lines(
            root / "prompts.txt",
            [f"prompt number {i}: a small red house by a lake" for i in range(args.prompts)],
        )
        validation = write_lines(root / "validation.txt", VALIDATION_PROMPTS)
        for family in FAMILIES:
            pipeline = build_pipeline(family, root / family, guidance_embeds=family == "flux")
            data, out = root / f"{family}_data", root / f"{family}_run"
            extra = {
                "prepare.validation_prompts": validation,
                "prepare.batch_size": 8,
                "prepare.shard_size": 32,
            }
            if args.pairs:
                extra["prepare.teacher_pairs"] = "true"
            overrides = [
                o
                for o in prepare_overrides(family, pipeline, data, prompts)
                if not o.startswith(("prepare.batch_size", "prepare.shard_size"))
            ]
            overrides += [f"{k}={v}" for k, v in extra.items()]
            started = time.perf_counter()
            assert prepare_main.run(compose_config(recipe(family), overrides), log=lambda line: None) == 0
            prepare_s = time.perf_counter() - started
            log = io.StringIO()
            started = time.perf_counter()
            with contextlib.redirect_stdout(log):
                code = train_main.run(
                    compose_config(recipe(family), train_overrides(family, pipeline, data, out)),
                    backend="local",
                )
            run_s = time.perf_counter() - started
            assert code == 0, log.getvalue()[-2000:]
            # Each validation's table: the seconds of each row (the teacher's is the same cached figure in both).
            blocks = log.getvalue().split("decoded samples at global step ")[1:]
            seconds = [[float(v) for v in re.findall(r"\| (\d+\.\d) \|\n", block)] for block in blocks]
            teacher = [rows_s[0] for rows_s in seconds[:1]]
            validations = [
                round(sum(rows_s[1:]) + (rows_s[0] if i == 0 else 0.0), 1) for i, rows_s in enumerate(seconds)
            ]
            rows.append({"family": family, "prompts": args.prompts, "pairs": args.pairs, "prepare_s": round(prepare_s, 2),
                         "prompts_per_s": round(args.prompts / prepare_s, 1), "run_s": round(run_s, 1),
                         "validation_s": validations, "teacher_row_s": teacher[:1]})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(
        "| family | prompts | prepare (s) | prompts/s | validation 1 (s) | validation 2 (s) | teacher row (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        v = r["validation_s"] + [float("nan")] * 2
        print(
            f"| {r['family']} | {r['prompts']} | {r['prepare_s']} | {r['prompts_per_s']} | {v[0]:.1f} | {v[1]:.1f} | "
            f"{r['teacher_row_s'][0] if r['teacher_row_s'] else '-'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
