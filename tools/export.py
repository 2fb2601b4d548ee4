"""Export a finished run again as a diffusers pipeline folder, and push it to the Hub: after eval_fid.py, so that
the model card holds the evaluation numbers, or to turn an export written before pipeline folders into one.

    python tools/export.py --run runs/flow_matching_demo                          # rewrites runs/.../export
    python tools/export.py --run runs/flow_matching_demo --push_to_hub me/demo    # and uploads it, private

The weights are the run's export (its EMA); the folder is written whole beside the old one, then put in its
place (training/sharing/pipeline_export.py). A post-hoc EMA is exported and pushed by tools/phema.py --std S
--push_to_hub.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.run import hub  # noqa: E402
from training.evaluation.sampling import load_model  # noqa: E402
from training.sharing import pipeline_export  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a run folder with an export")
    p.add_argument("--push_to_hub", default=None, metavar="REPO", help="owner/name: upload the folder there (private)")
    args = p.parse_args(argv)
    for problem in hub.push_problems(args.push_to_hub, "--push_to_hub"):  # before any work, in one line
        raise SystemExit(f"tools/export.py: {problem}")
    run = Path(args.run)
    if not (run / "export" / "transformer").is_dir():
        raise SystemExit(f"tools/export.py: {run / 'export'} holds no exported model (transformer/): train the run to "
                         f"its end, or export a post-hoc EMA with tools/phema.py")
    model, cfg, _ = load_model(run)
    ids = run / "export" / "class_ids.json"
    folder = pipeline_export.write(model, cfg, run / "export", json.loads(ids.read_text()) if ids.is_file() else None,
                                   run, repo=args.push_to_hub)
    print(f"exported {folder}")
    if args.push_to_hub:
        print(f"pushed to {hub.push(folder, args.push_to_hub)} (private)")
    return folder


if __name__ == "__main__":
    main()
