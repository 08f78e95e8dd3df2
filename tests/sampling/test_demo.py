"""The demo page: what one request returns, and the page itself in a real browser (headless Chromium from
Debian's packages, driven by selenium): load it, pick a class, generate, and see the images appear."""

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from moh_dit.sampling.demo import ALL_CLASSES, generate

from ..helpers.factories import make_image_folder, tiny_model, tiny_pipeline, train_tiny

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def test_one_request_gives_a_grid_a_head_heatmap_and_a_line():
    pipe = tiny_pipeline()
    grid, heads, info = generate(pipe, "dog", per_class=3, guidance=2.0, steps=3, scheduler="ddim", seed=1)
    assert grid.size[1] > 8 and heads is not None and heads.size[0] > 50
    assert info.startswith("3 images from") and "(ddim, 3 steps, guidance 2 at every step)" in info
    banded = generate(pipe, "dog", 3, 2.0, 3, "ddim", 1, guided_from=100, guided_to=600)
    assert "guidance 2 at timesteps 100-600" in banded[2] and banded[0].tobytes() != grid.tobytes()
    averaged = generate(pipe, "dog", 3, 2.0, 3, "ddim", 1, grid_averaging=500)
    assert "guidance 2 at every step, patch grids averaged at timesteps 0-500)" in averaged[2]
    assert averaged[0].tobytes() != grid.tobytes()
    with pytest.raises(ValueError, match="grid_averaging must be a timestep"):
        generate(pipe, "dog", 3, 2.0, 3, "ddim", 1, grid_averaging=1000)
    with pytest.raises(
        ValueError, match=r"guidance_interval must be two timesteps \[first, last\] with 0 <= first <= last"
    ):
        generate(pipe, "dog", 3, 2.0, 3, "ddim", 1, guided_from=700, guided_to=600)
    everything = generate(pipe, ALL_CLASSES, per_class=2, guidance=2.0, steps=2, scheduler="ddpm", seed=1)[0]
    assert everything.size[1] > grid.size[1]  # one row per class
    dit = tiny_pipeline(tiny_model(attention_type="mha", num_shared_heads=None, top_k=0, signal=0.1))
    assert generate(dit, "cat", 2, 2.0, 2, "dpm-solver", 0)[1] is None  # no routed heads, no heatmap


def test_the_page_samples_each_model_as_its_recorded_sampling_says():
    """The controls start at the model's record, and a request with them is the recorded spec itself: what the page
    does not show (time shift, guided channels, noise range, rule, cache) is kept, not dropped."""
    from moh_dit.sampling.demo import page_sampling, start_controls
    from moh_dit.sampling.spec import SamplingSpec

    flow = {"name": "flow", "path": "linear", "convention": "moh-dit"}
    pipe = tiny_pipeline(tiny_model(signal=0.1, learn_sigma=False, objective=flow), scheduler="euler")
    recorded = SamplingSpec.create(
        "euler", 5, 2.5, guidance_channels=1, guidance_noise=(0.5, 7.0), time_shift=2.0, grid_averaging=100,
        guidance_rule="apg", rule_options={"eta": 0.5}, cache="taylorseer", cache_options={"cache_interval": 2},
    )  # fmt: skip
    pipe.set_preview_sampling(recorded)
    start = start_controls(pipe)
    averaging = start["grid_averaging_to"] if start["grid_averaging"] else None
    controls = {k: start[k] for k in ("guidance", "steps", "scheduler", "guided_from", "guided_to")}
    assert page_sampling(pipe, **controls, grid_averaging=averaging) == recorded
    _, _, info = generate(pipe, "dog", 1, seed=0, grid_averaging=averaging, **controls)
    assert f"({recorded.describe()})" in info
    moved = page_sampling(pipe, **dict(controls, guided_from=100, guided_to=600), grid_averaging=None)
    assert moved.guidance.interval == (100, 600) and moved.sampler.time_shift == 2.0 and moved.cache is not None


def test_every_objectives_model_draws_with_the_page_defaults(tmp_path, monkeypatch):
    """Through the page's API, with no setting given: a DDPM, a flow and a MeanFlow model each draw with the sampler
    and steps they record (MeanFlow: one step, which the steps control offers)."""
    pytest.importorskip("gradio")
    from moh_dit.sampling.demo import api_endpoint, build_demo
    from moh_dit.sampling.spec import SamplingSpec

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    meanflow = {"name": "meanflow", "guidance_scale": 1.0, "guidance_mix": 0.0, "guidance_times": [0.0, 1.0]}
    flow = {"name": "flow", "path": "linear", "convention": "moh-dit"}
    models = {
        "ddpm": (tiny_pipeline(), None),
        "flow": (tiny_pipeline(tiny_model(signal=0.1, learn_sigma=False, objective=flow), scheduler="euler"), None),
        "meanflow": (
            tiny_pipeline(
                tiny_model(signal=0.1, learn_sigma=False, objective=meanflow, time_inputs=2), scheduler="meanflow"
            ),
            SamplingSpec.protocol("one-step", "meanflow", guidance_scale=1.0),
        ),
    }
    for name, (pipe, recorded) in models.items():
        pipe.set_preview_sampling(recorded)
        grid, _, info = api_endpoint(pipe)("dog", images=1)
        spec = pipe.preview_sampling
        scheduler = spec.sampler.scheduler if spec.sampler.scheduler in pipe.objective.samplers else None
        steps = spec.sampler.num_steps
        assert f"{scheduler or pipe.objective.samplers[0]}, {steps} step{'s' if steps != 1 else ''}," in info, name
        assert grid.size[0] > 8
        build_demo(pipe)  # the page builds with these controls (a 1-step MeanFlow model included)


def test_the_page_api_is_named_and_answers_a_script(tmp_path, monkeypatch):
    """A user's script calls the page as ``gradio_client`` does: one endpoint, ``/generate``, with named parameters;
    an unknown class and a step count out of range answer with one clear line."""
    pytest.importorskip("gradio")
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    from moh_dit.sampling.demo import build_demo

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    page = build_demo(tiny_pipeline(), title="api")
    _, url, _ = page.launch(server_port=_free_port(), prevent_thread_lock=True, quiet=True)
    try:
        client = Client(url, verbose=False, download_files=str(tmp_path))
        endpoint = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/generate"]
        names = [p["parameter_name"] for p in endpoint["parameters"]]
        assert names == [
            "class_name", "images", "guidance", "steps", "scheduler", "seed", "guided_from", "guided_to",
            "grid_averaging", "grid_averaging_to",
        ]  # fmt: skip
        grid, heads, info = client.predict(
            class_name="DOG", images=2, guidance=2.0, steps=3, scheduler="ddim", seed=1, api_name="/generate"
        )
        assert Path(grid["path"] if isinstance(grid, dict) else grid).is_file() and heads is not None
        assert info.startswith("2 images from") and "ddim, 3 steps, guidance 2" in info
        with pytest.raises(AppError, match="unknown class name 'purple'"):
            client.predict(class_name="purple", steps=3, api_name="/generate")
        with pytest.raises(AppError, match="Value 5000 is greater than maximum value 250"):  # the slider's range
            client.predict(class_name="dog", steps=5000, api_name="/generate")
        with pytest.raises(AppError, match=r"guidance_interval must be two timesteps \[first, last\]"):
            client.predict(class_name="dog", steps=3, guided_from=700, guided_to=600, api_name="/generate")
    finally:
        page.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a real browser; the API the page calls is tested through gradio_client in the default suite
@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and chromium-driver")
def test_the_page_in_a_browser(tmp_path):
    pytest.importorskip("gradio")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    make_image_folder(tmp_path / "images")
    # the page starts at the guidance the run drew its previews with, recorded with the exported weights
    recorded = ("preview.guidance_scale=2.5", "preview.guidance_interval=[100,600]", "preview.grid_averaging=100")
    train_tiny(tmp_path / "run", tmp_path / "images", "preview.per_class=0", *recorded)
    port = _free_port()
    env = {
        "PYTHONPATH": str(ROOT),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HOME": str(tmp_path),
        "PATH": "/usr/bin:/bin",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "moh_dit", "demo", str(tmp_path / "run"), "--port", str(port), "--no-browser"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    options = Options()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(flag)
    driver = None
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, (
                    server.stdout.read() if server.poll() else "timeout"
                )
                time.sleep(0.5)
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        driver.get(f"http://127.0.0.1:{port}/")
        box = WebDriverWait(driver, 60).until(ec.element_to_be_clickable((By.CSS_SELECTOR, "#class input")))
        box.click()
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys("dark")
        time.sleep(0.5)
        box.send_keys(Keys.ENTER)
        steps = driver.find_element(By.CSS_SELECTOR, "#steps input[type=number]")
        steps.send_keys(Keys.CONTROL, "a")
        steps.send_keys("3", Keys.TAB)
        driver.find_element(By.CSS_SELECTOR, "#generate").click()
        image = WebDriverWait(driver, 120).until(ec.presence_of_element_located((By.CSS_SELECTOR, "#grid img")))
        WebDriverWait(driver, 60).until(ec.presence_of_element_located((By.CSS_SELECTOR, "#heads img")))
        assert image.get_attribute("src").startswith(f"http://127.0.0.1:{port}/")
        WebDriverWait(driver, 30).until(lambda d: "images from" in d.find_element(By.CSS_SELECTOR, "#info").text)
        info = driver.find_element(By.CSS_SELECTOR, "#info").text
        assert "8 images from" in info
        assert "3 steps, guidance 2.5 at timesteps 100-600, patch grids averaged at timesteps 0-100)" in info
        with urllib.request.urlopen(image.get_attribute("src"), timeout=10) as response:
            assert response.read(8) == b"\x89PNG\r\n\x1a\n" or response.status == 200
        driver.save_screenshot(str(tmp_path / "demo.png"))
        assert (tmp_path / "demo.png").stat().st_size > 10_000
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)
