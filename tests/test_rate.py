"""tools/rate.py: the local rating page and its vote file, over HTTP and in a real headless browser (Debian's
chromium and chromium-driver through selenium; skipped, with the reason, where they are not installed).

Two sides are made as eval_fid.py output folders (generation.json and samples/) whose images are all red on one
side and all blue on the other, so a test can tell from the pixels which side the page put left."""
import io
import json
import shutil
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import rate  # noqa: E402
from training.evaluation import ratings  # noqa: E402

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}


def make_side(tmp_path, name, n=6, seed=0, num_classes=3, guidance=3.0):
    run = tmp_path / name
    folder = run / "eval" / f"export-ema-euler2-g{guidance:g}-seed{seed}"
    (folder / "samples").mkdir(parents=True)
    generation = {"model": {"run": str(run), "source": str(run / "export"), "weights": "ema (export)"},
                  "sampler": "euler", "steps": 2, "guidance_scale": guidance,
                  "seeds": {"seed": seed, "batch_size": 4}, "conditioning": {"labels": "i % num_classes",
                                                                             "num_classes": num_classes}}
    (folder / "generation.json").write_text(json.dumps(generation))
    for i in range(n):
        Image.new("RGB", (16, 16), COLOURS.get(name, (90, 160, 90))).save(folder / "samples" / f"{i:06d}.png")
    return folder


@pytest.fixture
def server_of(tmp_path):
    """server_of(folders) -> (study, base url); every server started is shut down after the test."""
    started = []

    def start(folders, num_samples=6):
        sides = rate.prepare([str(f) for f in folders], rate.parse_args(["-"]))
        study = rate.Study(sides, rate.sample_count(sides, num_samples))
        server = rate.serve(study, 0)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        started.append((server, thread))
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"  # never another interface
        return study, f"http://127.0.0.1:{port}"
    yield start
    for server, thread in started:
        server.shutdown()
        server.server_close()
        thread.join(5)
        assert not thread.is_alive()


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def post(url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + "/vote", data=data, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def colour_of(png):
    pixel = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))[0, 0]
    return next(name for name, rgb in COLOURS.items() if tuple(pixel) == rgb)


def lines(path):
    return path.read_text().splitlines() if path.exists() else []


def test_votes_are_recorded_and_bad_requests_get_400_and_write_nothing(tmp_path, server_of):
    red, blue = make_side(tmp_path, "red"), make_side(tmp_path, "blue")
    study, url = server_of([red, blue])
    page = get(url + "/").decode()
    assert "<script>" in page and "http" not in page.replace("http.server", "")  # no external assets
    shown = json.loads(get(url + "/next"))
    assert shown["kind"] == "pair" and shown["condition"] == f"class {shown['index'] % 3}"
    left = colour_of(get(f"{url}/image/{shown['token']}/left.png"))
    right = colour_of(get(f"{url}/image/{shown['token']}/right.png"))
    assert {left, right} == {"red", "blue"}
    files = [tmp_path / "red" / "ratings.jsonl", tmp_path / "blue" / "ratings.jsonl"]
    bad = [b"not json", json.dumps({"token": shown["token"]}).encode(),  # no choice
           {"token": shown["token"], "choice": "middle"}, {"token": shown["token"], "choice": True},
           {"token": shown["token"], "choice": "left", "extra": 1}, {"token": "f" * 32, "choice": "left"},
           {"token": 7, "choice": "left"}, [shown["token"], "left"], b"{" + b" " * 5000 + b"}"]
    for body in bad:
        code, reply = post(url, body)
        assert code == 400 and "error" in reply, body
    assert all(not lines(f) for f in files)  # nothing written by any of them
    code, reply = post(url, {"token": shown["token"], "choice": "left"})
    assert code == 200 and reply["vote"]["choice"] == "left"
    assert post(url, {"token": shown["token"], "choice": "right"})[0] == 400  # a token is used once
    for f in files:  # the same line in both runs' files
        (vote,) = map(json.loads, lines(f))
        assert vote["left"] == f"{left}/export-ema-euler2-g3" and vote["right"] == f"{right}/export-ema-euler2-g3"
        assert vote["index"] == shown["index"] and vote["seed"] == 0 and vote["condition"] == shown["condition"]
        assert vote["kind"] == "pair" and {"id", "time", "left_dir", "right_dir"} <= set(vote)
    with pytest.raises(urllib.error.HTTPError, match="404"):  # a token never issued has no images
        get(f"{url}/image/{'0' * 32}/left.png")
    with pytest.raises(urllib.error.HTTPError, match="404"):  # a used token's images are gone too
        get(f"{url}/image/{shown['token']}/left.png")


def test_concurrent_votes_never_interleave(tmp_path, server_of):
    red, blue = make_side(tmp_path, "red", n=24), make_side(tmp_path, "blue", n=24)
    study, url = server_of([red, blue], num_samples=24)
    tokens = [json.loads(get(url + "/next"))["token"] for _ in range(24)]
    results = []
    threads = [threading.Thread(target=lambda t=t: results.append(post(url, {"token": t, "choice": "tie"})))
               for t in tokens]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [code for code, _ in results] == [200] * 24
    for f in (tmp_path / "red" / "ratings.jsonl", tmp_path / "blue" / "ratings.jsonl"):
        votes = [json.loads(line) for line in lines(f)]  # every line a whole vote
        assert len(votes) == 24 and len({v["id"] for v in votes}) == 24
        assert sorted(v["index"] for v in votes) == list(range(24))
    assert json.loads(get(url + "/next"))["done"]


def test_a_restarted_study_skips_what_was_voted_and_sides_must_match(tmp_path, server_of):
    red, blue = make_side(tmp_path, "red", n=4), make_side(tmp_path, "blue", n=4)
    study, url = server_of([red, blue], num_samples=4)
    first = json.loads(get(url + "/next"))
    assert post(url, {"token": first["token"], "choice": "skip"})[0] == 200
    again, _ = server_of([red, blue], num_samples=4)
    assert len(again.queue) == 3 and first["index"] not in [i for i, _ in again.queue]
    other_seed = make_side(tmp_path, "crimson", n=4, seed=1)
    with pytest.raises(ValueError, match="differ in their seeds"):
        rate.prepare([str(red), str(other_seed)], rate.parse_args(["-"]))
    other_classes = make_side(tmp_path, "navy", n=4, num_classes=5)
    with pytest.raises(ValueError, match="differ in their conditioning"):
        rate.prepare([str(red), str(other_classes)], rate.parse_args(["-"]))
    with pytest.raises(ValueError, match="same model with the same settings"):
        rate.prepare([str(red), str(red)], rate.parse_args(["-"]))
    with pytest.raises(FileNotFoundError, match="no such folder"):
        rate.prepare([str(tmp_path / "nothing")], rate.parse_args(["-"]))


def test_a_pair_shown_but_not_voted_comes_back_and_the_votes_reach_the_report(tmp_path, server_of):
    red, blue = make_side(tmp_path, "red", n=3), make_side(tmp_path, "blue", n=3)
    (tmp_path / "red" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")  # a training run
    study, url = server_of([red, blue], num_samples=3)
    left_behind = json.loads(get(url + "/next"))  # then the page is reloaded (or the tab closed)
    left_colour = colour_of(get(f"{url}/image/{left_behind['token']}/left.png"))
    for left in (2, 1):  # the pair left behind counts as still to do
        shown = json.loads(get(url + "/next"))
        assert shown["index"] != left_behind["index"] and shown["remaining"] == left
        assert post(url, {"token": shown["token"], "choice": "tie"})[0] == 200
    again = json.loads(get(url + "/next"))  # not "done": the pair left behind is shown again, as it was
    assert not again["done"] and again["index"] == left_behind["index"] and again["remaining"] == 0
    assert colour_of(get(f"{url}/image/{again['token']}/left.png")) == left_colour
    assert not (tmp_path / "red" / "report.md").exists()
    assert post(url, {"token": again["token"], "choice": "left"})[0] == 200
    assert post(url, {"token": left_behind["token"], "choice": "left"})[0] == 400  # one vote per pair
    assert json.loads(get(url + "/next"))["done"]
    assert len(lines(tmp_path / "red" / "ratings.jsonl")) == 3
    report = (tmp_path / "red" / "report.md").read_text()  # written when the study was done, no command by hand
    assert "## Human ratings (tools/rate.py, 3 votes)" in report and "win rate" in report
    assert not (tmp_path / "blue" / "report.md").exists()  # not a training run folder: no report


def test_one_run_mode_rates_1_to_5_and_lists_the_worst_seeds(tmp_path, server_of, capsys):
    green = make_side(tmp_path, "green", n=5)
    study, url = server_of([green], num_samples=5)
    given = {}
    for _ in range(5):
        shown = json.loads(get(url + "/next"))
        assert shown["kind"] == "rating"
        get(f"{url}/image/{shown['token']}/single.png")
        assert post(url, {"token": shown["token"], "choice": "left"})[0] == 400  # not a rating
        assert post(url, {"token": shown["token"], "choice": 6})[0] == 400
        given[shown["index"]] = 1 + shown["index"] % 5
        assert post(url, {"token": shown["token"], "choice": given[shown["index"]]})[0] == 200
    rate.main(["--summary", str(tmp_path / "green")])
    out = capsys.readouterr().out
    assert "mean rating 3.00" in out and "over 5 ratings (1: 1, 2: 1, 3: 1, 4: 1, 5: 1)" in out
    assert "worst: sample 0 (seed 0), 'class 0': 1.0" in out.splitlines()[1]


# ---- In a real browser ---------------------------------------------------------------------------------------


def browser():
    """A headless Chromium through selenium, or pytest.skip saying what is missing and how to install it."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -r requirements.txt)")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("the browser test needs Debian's chromium and chromium-driver (apt-get install chromium "
                    "chromium-driver; .ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def test_without_chromium_the_browser_test_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium chromium-driver"):
        browser()


@pytest.mark.slow  # 2-3 s: the fast tier stays under 60 s
def test_rating_in_a_headless_browser_by_clicks_and_keys_in_two_tabs(tmp_path, server_of, capsys):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    red, blue = make_side(tmp_path, "red"), make_side(tmp_path, "blue")
    study, url = server_of([red, blue])
    driver = browser()
    try:
        def loaded(previous=None):  # the page shows a new pair (or is done): its token changed
            WebDriverWait(driver, 10).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-token")
                                            not in (None, "", previous))
            return driver.find_element(By.TAG_NAME, "body").get_attribute("data-token")

        def red_side():  # which side the page shows red, read from the image it loaded
            src = driver.find_element(By.ID, "img-left").get_attribute("src")
            return "left" if colour_of(get(src)) == "red" else "right"

        driver.get(url + "/")
        tabs = [driver.current_window_handle]
        token = loaded()
        assert "class" in driver.find_element(By.ID, "condition").text
        # Tab 1: click "red" (A or B, wherever it is), then press the key for red.
        driver.find_element(By.ID, f"vote-{red_side()}").click()
        token = loaded(token)
        driver.find_element(By.TAG_NAME, "body").send_keys("a" if red_side() == "left" else "b")
        token = loaded(token)
        # Tab 2, open at the same time: red again by key, then a tie by click.
        driver.switch_to.new_window("tab")
        tabs.append(driver.current_window_handle)
        driver.get(url + "/")
        other = loaded()
        driver.find_element(By.TAG_NAME, "body").send_keys("a" if red_side() == "left" else "b")
        other = loaded(other)
        driver.find_element(By.ID, "vote-tie").click()
        other = loaded(other)
        # Back in tab 1, whose pair is still pending: blue by click. The queue is then empty, but tab 2's pair has
        # no vote: tab 1 is shown it too (not "done"), and skips it by key; now it is done.
        driver.switch_to.window(tabs[0])
        driver.find_element(By.ID, f"vote-{'right' if red_side() == 'left' else 'left'}").click()
        token = loaded(token)
        assert token != "done" and "Done" not in driver.find_element(By.ID, "condition").text
        driver.find_element(By.TAG_NAME, "body").send_keys("s")
        assert loaded(token) == "done"
        # Tab 2 still shows that pair: its vote is refused (the pair has one), and it is done too, with the summary.
        driver.switch_to.window(tabs[1])
        driver.find_element(By.TAG_NAME, "body").send_keys("s")
        assert loaded(other) == "done" and "Done" in driver.find_element(By.ID, "condition").text
        assert "vote refused" in driver.find_element(By.ID, "error").text
        summary = driver.find_element(By.ID, "summary").text
        assert "red/export-ema-euler2-g3 vs blue/export-ema-euler2-g3: win rate 0.700" in summary  # (3 + 1/2) / 5
    finally:
        driver.quit()
    votes = [json.loads(line) for line in lines(tmp_path / "red" / "ratings.jsonl")]
    assert lines(tmp_path / "red" / "ratings.jsonl") == lines(tmp_path / "blue" / "ratings.jsonl")
    winners = [v[v["choice"]].split("/")[0] if v["choice"] in ("left", "right") else v["choice"] for v in votes]
    assert winners == ["red", "red", "red", "tie", "blue", "skip"]
    assert sorted(v["index"] for v in votes) == list(range(6))
    rate.main(["--summary", str(tmp_path / "red"), str(tmp_path / "blue")])
    out = capsys.readouterr().out
    assert ("red/export-ema-euler2-g3 vs" in out or "vs red/export-ema-euler2-g3" in out) and "over 5 votes" in out
    rates = ratings.win_rate(votes, "red/export-ema-euler2-g3", "blue/export-ema-euler2-g3")
    assert (rates["wins"], rates["losses"], rates["ties"], rates["skips"], rates["rate"]) == (3, 1, 1, 1, 0.7)
