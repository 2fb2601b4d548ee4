"""Human ratings of samples on a local page: two or more runs side by side (A, B, tie, skip), or one run rated 1-5.

    python tools/rate.py runs/flow_matching_demo runs/ddpm_demo --num_samples 64     # pairs: serves a page
    python tools/rate.py runs/a runs/a/checkpoints/step_00001000 runs/b/eval/export-ema-euler32-g3-seed0
    python tools/rate.py runs/flow_matching_demo                                     # one run: 1-5 stars
    python tools/rate.py --summary runs/flow_matching_demo runs/ddpm_demo             # win rate / Bradley-Terry

Each item is a run folder (its export), a checkpoint folder, or an eval_fid.py output folder (generation.json
and samples/), whose PNGs are reused as they are. Runs and checkpoints are sampled through eval_fid.py
--generate_only with the same --seed and --num_samples, so sample i has the same noise and the same condition
(class i % num_classes, or prompt i) on every side; items whose seeds or conditions differ are refused.

The page (Python's http.server, bound to 127.0.0.1 only; no external assets) shows one sample index at a time:
two sides in random left/right order with the condition named, buttons and keys a / b / t / s (or the arrow
keys and space); in one-run mode 1-5 and s. Every vote is appended (under a lock, one write per line) to
ratings.jsonl in the run folder of each side it involves (format: training/evaluation/ratings.py). A vote must name a
token the server issued for a pair it showed, once; anything else is HTTP 400 and writes nothing. A pair shown
but not voted on (a reload, a closed tab) is shown again once the queue is empty; the page says done only when
every pair has a vote. Restarting the same study skips what was already voted on. When the study is done, and
when rate.py stops, each run's report.md is rewritten with the votes; --summary prints them.
"""
import argparse
import fcntl
import hashlib
import itertools
import json
import random
import secrets
import sys
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: eval_fid, sample, the package

from training.data.classes import readable_names  # noqa: E402
from training.evaluation import ratings  # noqa: E402

PAIR_CHOICES = ("left", "right", "tie", "skip")
STAR_CHOICES = (1, 2, 3, 4, 5, "skip")


def parse_args(argv=None):
    a = (p := argparse.ArgumentParser(description=__doc__.split("\n")[0])).add_argument
    a("items", nargs="+", help="run folders, checkpoint folders or eval_fid.py output folders (with samples/)")
    a("--summary", action="store_true", help="print what the votes in these run folders say, and stop")
    a("--num_samples", type=int, default=32, help="sample indices 0 .. N-1 are rated (generated when missing)")
    a("--seed", type=int, default=0, help="eval_fid.py's --seed: sample i's noise is seed_for(seed, 0, i)")
    a("--batch_size", type=int, default=16)
    a("--steps", type=int, default=None, help="default: each run's val.steps")
    a("--sampler", default=None, help="default: each run's val.sampler")
    a("--guidance_scale", type=float, default=None, help="default: each run's val.guidance_scale")
    a("--prompts", default=None, help="text runs: a captions file (default: the held-out captions)")
    a("--port", type=int, default=8000, help="on 127.0.0.1; 0 picks a free one")
    args = p.parse_args(argv)
    if args.num_samples < 1 or args.batch_size < 1 or not 0 <= args.port < 65536:
        p.error("--num_samples and --batch_size must be >= 1 and --port in 0 .. 65535")
    return args


# ----------------------------------------------------------------------------------------------------------
# Sides: one samples folder each, with its settings, its label and the run folder its votes go to.


def generate(item, args):
    """An eval_fid.py output folder of `item` (a run, export or checkpoint folder) with args.num_samples PNGs,
    made by eval_fid.py --generate_only (a folder made before with the same settings is resumed, not redone)."""
    import eval_fid  # here, not at the top: the rating server starts without torch, and often never generates

    item = Path(item)
    run, ckpt = (item.parents[1], item) if (item / "state.pt").is_file() else (item, None)
    extra = [*(["--checkpoint", str(ckpt)] if ckpt else []), *(["--steps", str(args.steps)] if args.steps else []),
             *(["--sampler", args.sampler] if args.sampler else []),
             *(["--prompts", args.prompts] if args.prompts else []),
             *(["--guidance_scale", str(args.guidance_scale)] if args.guidance_scale is not None else [])]
    digest = hashlib.sha256(json.dumps(extra).encode()).hexdigest()[:8]
    out = run / "eval" / f"rate-{ckpt.name if ckpt else 'export'}-seed{args.seed}-{digest}"
    # A text run's default is the held-out captions, any number of samples, as before eval_fid.py's became the
    # reference rows' (the same captions at its default reference): named here, so the folder's digest is as before.
    eval_fid.main(["--run", str(run), "--num_samples", str(args.num_samples), "--seed", str(args.seed),
                   "--batch_size", str(args.batch_size), "--out_dir", str(out), "--generate_only", *extra,
                   *([] if args.prompts else ["--prompts", "heldout"])])
    return out


def side_of(folder):
    """{label, dir, run, generation} of an eval_fid.py output folder. The votes go to the run it was sampled
    from (generation.json's model.run, an export's parent), else the folder above eval/, else the folder."""
    folder = Path(folder).resolve()
    generation = json.loads((folder / "generation.json").read_text())
    model = generation["model"]
    run = Path(model["run"]).resolve()
    if run.name == "export" and (run / "transformer").is_dir():
        run = run.parent
    if not run.is_dir():
        run = folder.parents[1] if folder.parent.name == "eval" else folder
    weights = "export-ema" if "export" in model["weights"] else f"{Path(model['source']).name}-{model['weights']}"
    label = f"{run.name}/{weights}-{generation['sampler']}{generation['steps']}-g{generation['guidance_scale']:g}"
    return {"label": label, "dir": folder, "run": run, "generation": generation}


def condition_names(side):
    """names(i) -> the condition of sample i in words: 'class 3: blue square' or the prompt."""
    cond, run = side["generation"]["conditioning"], side["run"]
    if "labels" in cond:
        from training.evaluation.sampling import run_class_ids  # (torch: class runs only)

        source = side["generation"]["model"]
        ckpt = source["source"] if "step" in source else None
        ids = (run_class_ids(run, ckpt) if (run / "export").is_dir() or ckpt else None)
        names = readable_names(ids) if ids else None
        k = cond["num_classes"]
        return lambda i: f"class {i % k}" + (f": {names[i % k]}" if names else "")
    prompts = cond["prompts"]
    if prompts == "reference":  # eval_fid.py's text protocol: sample i has line i % R of the folder's prompts.txt
        prompts = str(side["dir"] / "prompts.txt")
    if Path(prompts).is_file():
        lines = [s.strip() for s in Path(prompts).read_text().splitlines() if s.strip()]
    elif (run / "config.json").is_file():
        from training.evaluation.generation import load_prompts  # (torch: text runs only)

        lines = load_prompts(prompts, json.loads((run / "config.json").read_text()))
    else:
        return lambda i: f"prompt {i % cond['num_prompts']} of {prompts}"
    return lambda i: lines[i % len(lines)]


def prepare(items, args):
    """The sides, checked before anything is served: distinct labels, one seed and one set of conditions."""
    sides = []
    for item in items:
        path = Path(item)
        if not path.is_dir():
            raise FileNotFoundError(f"{item}: no such folder (give run, checkpoint or eval_fid.py output folders)")
        is_eval = (path / "generation.json").is_file() and (path / "samples").is_dir()
        sides.append(side_of(path if is_eval else generate(path, args)))
    labels = [s["label"] for s in sides]
    if len(set(labels)) < len(labels):
        raise ValueError(f"two items are the same model with the same settings: {labels}")
    first = sides[0]["generation"]
    for side in sides[1:]:
        for key in ("seeds", "conditioning"):
            a, b = first[key], side["generation"][key]
            if key == "seeds":
                a, b = a["seed"], b["seed"]
            if a != b:
                raise ValueError(f"{sides[0]['dir']} and {side['dir']} differ in their {key} ({a} vs {b}): sample "
                                 f"i would not show the same noise and condition on both sides")
    return sides


def sample_count(sides, limit):
    """How many sample indices 0 .. n-1 every side has as PNGs (at most `limit`)."""
    n = 0
    while n < limit and all((s["dir"] / "samples" / f"{n:06d}.png").is_file() for s in sides):
        n += 1
    if n == 0:
        raise FileNotFoundError(f"{sides[0]['dir']}/samples has no 000000.png on every side")
    return n


# ----------------------------------------------------------------------------------------------------------
# The study: what is shown next, and the vote file.


class BadVote(ValueError):
    pass


class Study:
    """The queue of (index, sides) still to vote on, the tokens of what was shown, and the vote files.

    An item shown but not voted on (a reload, a closed tab, another tab) stays pending: once the queue is empty
    it is shown again, under a new token, so nothing shown is lost and the study is done only when every item
    has a vote (skip counts). The first vote on an item ends it: its other tokens are refused (HTTP 400)."""

    def __init__(self, sides, num_samples):
        self.sides, self.lock, self.pending = sides, threading.Lock(), {}  # token -> (index, shown), in issue order
        self.kind = "rating" if len(sides) == 1 else "pair"
        self.seed = sides[0]["generation"]["seeds"]["seed"]
        self.names = condition_names(sides[0])
        self.files = sorted({s["run"] / ratings.VOTES_FILE for s in sides})
        done = set()
        for v in ratings.read_votes(self.files):
            if v.get("kind") == self.kind and v.get("seed") == self.seed:
                done.add((v["index"], v["side"]) if self.kind == "rating" else (v["index"], v["left"], v["right"]))
                if self.kind == "pair":
                    done.add((v["index"], v["right"], v["left"]))
        rng = random.SystemRandom()  # the left/right order must not be guessable
        pairs = [(a,) for a in range(len(sides))] if len(sides) == 1 else \
            list(itertools.combinations(range(len(sides)), 2))
        self.queue = [(i, rng.sample(p, len(p))) for i in range(num_samples) for p in pairs
                      if (i, *(sides[j]["label"] for j in p)) not in done]
        rng.shuffle(self.queue)
        self.voted, self.reported = 0, 0

    def next(self):
        """The page's next item and a token for it: from the queue, else the item shown longest ago without a
        vote; {'done': True} when neither is left."""
        with self.lock:
            if not self.queue and not self.pending:
                return {"done": True, "voted": self.voted, "summary": self.summary()}
            index, shown = self.queue.pop() if self.queue else next(iter(self.pending.values()))
            token = secrets.token_hex(16)
            self.pending[token] = (index, shown)
            open_items = {(i, tuple(s)) for i, s in self.pending.values()}
            return {"done": False, "token": token, "kind": self.kind, "index": index, "condition": self.names(index),
                    "remaining": len(self.queue) + len(open_items) - 1, "voted": self.voted}

    def image(self, token, slot):
        """The PNG bytes of a pending token's left, right (pairs) or only image, or None."""
        with self.lock:
            index, shown = self.pending.get(token, (None, None))
        slots = {"left": 0, "right": 1} if self.kind == "pair" else {"single": 0}
        if index is None or slot not in slots:
            return None
        return (self.sides[shown[slots[slot]]]["dir"] / "samples" / f"{index:06d}.png").read_bytes()

    def vote(self, body):
        """Record a vote {token, choice} for what that token showed; BadVote (and nothing written) otherwise."""
        if not isinstance(body, dict) or set(body) != {"token", "choice"}:
            raise BadVote("a vote is a JSON object with exactly 'token' and 'choice'")
        choices = PAIR_CHOICES if self.kind == "pair" else STAR_CHOICES
        choice = body["choice"]
        if isinstance(choice, bool) or choice not in choices:
            raise BadVote(f"choice must be one of {list(choices)}, got {choice!r}")
        with self.lock:
            if not isinstance(body["token"], str) or body["token"] not in self.pending:
                raise BadVote("this token was not issued for a shown pair, or was already used")
            index, shown = self.pending.pop(body["token"])
            for token in [t for t, item in self.pending.items() if item == (index, shown)]:  # shown again elsewhere
                del self.pending[token]
            record = {"id": secrets.token_hex(8), "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "kind": self.kind, "index": index, "seed": self.seed, "condition": self.names(index)}
            sides = [self.sides[j] for j in shown]
            if self.kind == "pair":
                record.update(left=sides[0]["label"], right=sides[1]["label"], left_dir=str(sides[0]["dir"]),
                              right_dir=str(sides[1]["dir"]))
            else:
                record.update(side=sides[0]["label"], dir=str(sides[0]["dir"]))
            record["choice"] = choice
            line = json.dumps(record) + "\n"
            for path in sorted({s["run"] / ratings.VOTES_FILE for s in sides}):
                with open(path, "a") as f:  # one write per line, under an exclusive lock (other rate.py processes)
                    fcntl.flock(f, fcntl.LOCK_EX)
                    f.write(line)
                    f.flush()
                    fcntl.flock(f, fcntl.LOCK_UN)
            self.voted += 1
            return record

    def write_reports(self):
        """Rewrite report.md of each side's run (a training run folder: metrics.jsonl) when votes came since the
        last time, so the votes reach the report (its "Human ratings" section) without a command by hand."""
        from training.record.report import write_report  # (matplotlib: once votes came)

        with self.lock:
            if self.voted == self.reported:
                return []
            self.reported = self.voted
            runs = sorted({s["run"] for s in self.sides if (s["run"] / "metrics.jsonl").is_file()})
            return [write_report(run) for run in runs]

    def summary(self):
        labels = {s["label"] for s in self.sides}
        return ratings.summary_lines([v for v in ratings.read_votes(self.files)
                                      if {v.get("left"), v.get("right"), v.get("side")} - {None} <= labels])


# ----------------------------------------------------------------------------------------------------------
# The server: 127.0.0.1 only.


def handler_for(study):
    class Handler(BaseHTTPRequestHandler):
        def reply(self, code, body, kind="application/json"):
            data = body if isinstance(body, bytes) else \
                (json.dumps(body) if kind == "application/json" else body).encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            parts = self.path.split("?")[0].strip("/").split("/")
            if parts == [""]:
                return self.reply(200, PAGE, "text/html; charset=utf-8")
            if parts == ["next"]:
                shown = study.next()
                if shown["done"]:
                    study.write_reports()
                return self.reply(200, shown)
            if parts == ["summary"]:
                return self.reply(200, {"lines": study.summary()})
            if len(parts) == 3 and parts[0] == "image" and parts[2].endswith(".png"):
                png = study.image(parts[1], parts[2][:-4])
                if png is not None:
                    return self.reply(200, png, "image/png")
            return self.reply(404, {"error": "not found"})

        def do_POST(self):
            if self.path != "/vote":
                return self.reply(404, {"error": "not found"})
            try:
                length = int(self.headers.get("Content-Length", ""))
                if not 0 < length <= 4096:
                    raise BadVote("a vote needs a Content-Length of 1 .. 4096 bytes")
                body = json.loads(self.rfile.read(length))
                return self.reply(200, {"ok": True, "vote": study.vote(body)})
            except (ValueError, UnicodeDecodeError) as e:  # BadVote, a bad length, JSON that does not parse
                return self.reply(400, {"error": str(e)})

        def log_message(self, *args):  # quiet: the page is the interface
            pass
    return Handler


def serve(study, port=0):
    """A ThreadingHTTPServer on 127.0.0.1 (never another interface); call serve_forever(), then shutdown()."""
    class Server(ThreadingHTTPServer):
        daemon_threads, request_queue_size = True, 64  # a burst of votes is queued, not retried after 1 s
    return Server(("127.0.0.1", port), handler_for(study))


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>rate samples</title>
<style>
 body { font-family: sans-serif; margin: 2em; text-align: center; }
 #images { display: flex; justify-content: center; gap: 2em; margin: 1em 0; }
 #images img { width: 320px; height: 320px; image-rendering: pixelated; border: 1px solid #999; }
 figcaption { font-size: 1.4em; font-weight: bold; }
 button { font-size: 1.1em; margin: 0.3em; padding: 0.4em 1em; }
 #condition { font-size: 1.3em; } #progress, #error { color: #666; } #error { color: #b00; }
 pre { text-align: left; display: inline-block; }
</style></head>
<body>
<h2 id="condition">loading...</h2>
<div id="images"></div>
<div id="buttons"></div>
<p id="progress"></p><p id="error"></p><pre id="summary"></pre>
<script>
let current = null, busy = false;
const PAIR = [["left", "A (left)", "a"], ["tie", "tie", "t"], ["right", "B (right)", "b"], ["skip", "skip", "s"]];
const STARS = [[1, "1", "1"], [2, "2", "2"], [3, "3", "3"], [4, "4", "4"], [5, "5", "5"], ["skip", "skip", "s"]];
const KEYS = {ArrowLeft: "left", ArrowRight: "right", ArrowDown: "tie", " ": "skip"};
function el(tag, attrs, text) {
  const e = document.createElement(tag); Object.assign(e, attrs); if (text) e.textContent = text; return e;
}
async function next() {
  current = await (await fetch("/next")).json();
  const images = document.getElementById("images"), buttons = document.getElementById("buttons");
  images.replaceChildren(); buttons.replaceChildren();
  document.body.dataset.token = current.token || "done";
  if (current.done) {
    document.getElementById("condition").textContent = "Done: every sample has a vote (or a skip). Thank you.";
    document.getElementById("progress").textContent = current.voted + " votes this session";
    document.getElementById("summary").textContent = current.summary.join("\\n");
    return;
  }
  document.getElementById("condition").textContent = "sample " + current.index + " - " + current.condition;
  const slots = current.kind === "pair" ? [["left", "A"], ["right", "B"]] : [["single", "rate 1 (bad) to 5 (good)"]];
  for (const [slot, name] of slots) {
    const fig = el("figure", {});
    fig.append(el("img", {id: "img-" + slot, src: "/image/" + current.token + "/" + slot + ".png", alt: name}));
    fig.append(el("figcaption", {}, name));
    images.append(fig);
  }
  for (const [choice, text, key] of current.kind === "pair" ? PAIR : STARS) {
    const b = el("button", {id: "vote-" + choice}, text + " [" + key + "]");
    b.onclick = () => vote(choice);
    buttons.append(b);
  }
  document.getElementById("progress").textContent =
    current.voted + " votes this session, " + current.remaining + " left";
}
async function vote(choice) {
  if (!current || current.done || busy) return;
  busy = true;
  try {
    const r = await fetch("/vote", {method: "POST", headers: {"Content-Type": "application/json"},
                                    body: JSON.stringify({token: current.token, choice: choice})});
    document.getElementById("error").textContent = r.ok ? "" : "vote refused: " + (await r.json()).error;
    await next();
  } finally { busy = false; }
}
document.addEventListener("keydown", e => {
  if (!current || current.done) return;
  const table = current.kind === "pair" ? PAIR : STARS;
  const hit = table.find(([, , key]) => key === e.key);
  const choice = hit ? hit[0] : (current.kind === "pair" ? KEYS[e.key] : (e.key === " " ? "skip" : undefined));
  if (choice !== undefined) { e.preventDefault(); vote(choice); }
});
next();
</script></body></html>
"""


def main(argv=None):
    args = parse_args(argv)
    if args.summary:
        runs = [side_of(p)["run"] if (Path(p) / "generation.json").is_file() else Path(p) for p in args.items]
        lines = ratings.summary_lines(ratings.read_votes(runs))
        print("\n".join(lines))
        return lines
    sides = prepare(args.items, args)
    study = Study(sides, sample_count(sides, args.num_samples))
    server = serve(study, args.port)
    print(f"{len(sides)} side(s): " + ", ".join(s["label"] for s in sides))
    print(f"{len(study.queue)} to rate; votes go to " + ", ".join(map(str, study.files)))
    print(f"open http://127.0.0.1:{server.server_address[1]}/ in a browser (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    print("\n".join(study.summary()))
    for path in study.write_reports():
        print(f"votes in the report: {path}")
    return study


if __name__ == "__main__":
    main()
