"""Regenerate the Temporal Web UI screenshots in docs/ (README, "From the Temporal CLI / UI").

    .venv/bin/python docs/screenshots/temporal_ui.py     # about 4-6 minutes on 2 cores

Needs Debian's `chromium` (`apt-get install -y chromium`). With the project's own pieces,
not copies of them, it:

1. starts a private Temporal dev server *with* its Web UI (ops/services.py
   TemporalDevServer; free ports, a fresh state directory);
2. runs `mainspring demo` against it (ops/demo.py run_demo: the worker fleet under its
   process manager, live progress, the summary, the report) on the demo preset with its
   injected faults — the trainer worker killed at step 50, corrupt batches at step 110 (a
   loss spike and a rollback) — and DEMO_OVERRIDES below;
3. drives headless Chromium over the Chrome DevTools protocol (aiohttp's websocket
   client) and saves, each cut to the part of the page that matters, under ~600 KB:

   - docs/temporal-ui-faulted-run.png — while the run trains on after the kill: its
     User Metadata tab, the static summary and details and the Current Details (the
     headline: stage, step, loss, faults recovered; the steps running now). The UI shows
     Current Details only while the run is open (it asks a worker with a query);
   - docs/temporal-ui-memo.png — the completed run's Memo tab: the headline it leaves;
   - docs/temporal-ui-timeline.png — the completed run's timeline: one bar per activity
     with its summary (`segment 0–80 of 240`, ...), the killed segment marked with its 2
     attempts and red where the first one failed;
   - docs/temporal-ui-history.png — its event history, Compact, the faulted segment
     opened: attempt 2 and the failure of attempt 1 (`activity Heartbeat timeout`).

The UI is a single-page app: each shot waits until the page's text (or its Markdown
iframes') shows the run, not a spinner, then lets it settle. A run that continues as new
gets one header and timeline per execution, from the faulted one on. Exit status 1 when
the run failed or a shot is missing. `--serve` keeps the server up at the end (SIGTERM or
Ctrl-C ends it); `--ui URL --address HOST:PORT --run-id ID` takes the shots of a finished
run on a server that is up (all but the live one), running nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import aiohttp  # noqa: E402 - after the path: run as a script from anywhere
from PIL import Image  # noqa: E402

import ops.demo  # noqa: E402
from ops.client import connect  # noqa: E402
from ops.demo import run_demo  # noqa: E402
from ops.services import TemporalDevServer, free_port, wait_for_port  # noqa: E402

DOCS = os.path.join(ROOT, "docs")
# The demo preset, its faults kept (the trainer worker killed at step 50, corrupt batches at
# 110), with a third segment and all three in one workflow execution (no continue-as-new):
# one timeline then holds the whole run, the static summary stays on it, and the later
# segments train long enough for a shot of the open run's Current Details.
DEMO_OVERRIDES = {"train.total_steps": 240, "train.segments_per_run": 3}
WIDTH, HEIGHT = 1600, 1200  # the window; each shot is cut to the content it shows
TALL = 3200  # the window's height while shooting (the Web UI renders only what fits)
MAX_BYTES = 600_000
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  f"--window-size={WIDTH},{HEIGHT}", "--hide-scrollbars",
                  "--disable-extensions", "--no-first-run", "--mute-audio"]


def say(*parts: object) -> None:
    print(f"[screenshots {time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


# ---- the run --------------------------------------------------------------------------
async def find_run_id(client, timeout_s: float = 120.0) -> str:
    """The demo's run id: the one TrainingRun on this private server."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async for wf in client.list_workflows('WorkflowType = "TrainingRun"'):
            return wf.id
        await asyncio.sleep(1.0)
    raise TimeoutError("no TrainingRun started")


async def chain(client, run_id: str) -> list[Any]:
    """The executions of the run's continue-as-new chain, oldest first."""
    runs = [wf async for wf in client.list_workflows(f'WorkflowId = "{run_id}"')]
    return sorted(runs, key=lambda wf: wf.start_time)


async def memo(client, run_id: str) -> tuple[str, dict[str, Any]]:
    """(execution, memo) of the run's latest execution; ("", {}) between two of them."""
    try:
        desc = await client.get_workflow_handle(run_id).describe()
        return desc.run_id, await desc.memo()
    except Exception:  # noqa: BLE001 - between continue-as-new links: try again
        return "", {}


async def faulted_execution(client, run_id: str) -> str:
    """The run id (execution) of the chain link whose history holds a failed or timed-out
    activity attempt (the kill), else the first link that retried one, else the first."""
    runs = await chain(client, run_id)
    retried = None
    for wf in runs:
        handle = client.get_workflow_handle(run_id, run_id=wf.run_id)
        async for ev in handle.fetch_history_events():
            if ev.HasField("activity_task_failed_event_attributes") or \
                    ev.HasField("activity_task_timed_out_event_attributes"):
                return wf.run_id
            if ev.HasField("activity_task_started_event_attributes") and \
                    ev.activity_task_started_event_attributes.attempt > 1:
                retried = retried or wf.run_id
    return retried or runs[0].run_id


# ---- headless Chromium over the DevTools protocol --------------------------------------
# In the page: the rectangle (page coordinates) of the first smallest `selector` element
# whose text holds `text` and, with `within`, of its smallest ancestor whose text holds
# `within` too.
RECT_JS = """((text, within, selector) => {
  const hit = [...document.querySelectorAll(selector)].filter(e => e.offsetParent !== null
      && e.innerText && e.innerText.includes(text)
      && ![...e.children].some(c => c.innerText && c.innerText.includes(text)));
  let e = hit[0];
  while (e && within && !e.innerText.includes(within)) e = e.parentElement;
  if (!e) return null;
  const r = e.getBoundingClientRect();
  return {x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height};
})"""


class Page:
    """One Chromium tab, driven with CDP commands over the websocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self._id, self.width, self.height = ws, 0, WIDTH, TALL

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        await self.ws.send_json({"id": self._id, "method": method, "params": params})
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def js(self, expr: str) -> Any:
        r = await self.send("Runtime.evaluate", expression=expr, returnByValue=True,
                            awaitPromise=True)
        return r.get("result", {}).get("value")

    async def viewport(self, width: int, height: int = TALL) -> None:
        """The UI scrolls inside its own pane, 100% of the window high: only a window
        as tall as the content renders all of it."""
        self.width, self.height = width, height
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                        deviceScaleFactor=1, mobile=False)

    async def goto(self, url: str, until: str, timeout_s: float = 90.0,
                   settle_s: float = 4.0) -> None:
        """Navigate, wait until the page's text contains `until` (the SPA rendered, not a
        spinner), let it settle, and widen the window if the content is wider."""
        await self.viewport(WIDTH)
        await self.send("Page.navigate", url=url)
        await self.wait_text(until, timeout_s)
        await asyncio.sleep(settle_s)
        await self.fit_width()

    async def fit_width(self) -> None:
        """Widen the window to the content's right edge (a wide table is cut off, not
        wrapped)."""
        right = await self.js("Math.max(...[...document.querySelectorAll('main *')]"
                              ".filter(e => e.offsetParent !== null)"
                              ".map(e => e.getBoundingClientRect().right))")
        if right and right + 24 > self.width:
            await self.viewport(int(right) + 24, self.height)
            await asyncio.sleep(1.5)

    async def wait_text(self, text: str, timeout_s: float = 90.0) -> None:
        """Until the page's text, or that of one of its frames (the UI renders the user
        metadata's Markdown in iframes), contains `text`."""
        deadline = time.monotonic() + timeout_s
        probe = f"""document.body && [document, ...[...document.querySelectorAll('iframe')]
            .map(f => f.contentDocument)].some(d => d && d.body
            && d.body.innerText.includes({json.dumps(text)}))"""
        while not await self.js(probe):
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never showed {text!r}")
            await asyncio.sleep(0.5)

    async def click(self, text: str, selector: str) -> None:
        """Click the first visible `selector` element whose text is `text` (for table
        rows: matches `text` as a regular expression)."""
        ok = await self.js(f"""(() => {{
            const re = new RegExp({json.dumps(text)});
            for (const el of document.querySelectorAll({json.dumps(selector)})) {{
                const t = (el.innerText || '').trim();
                if (el.offsetParent !== null && (t === {json.dumps(text)}
                    || (el.tagName === 'TR' && re.test(t)))) {{
                    el.click(); return true; }}
            }}
            return false; }})()""")
        if not ok:
            raise RuntimeError(f"nothing to click with text {text!r}")
        await asyncio.sleep(3.0)
        await self.fit_width()

    async def rect(self, text: str, within: str = "", selector: str = "main *"
                   ) -> dict[str, float]:
        args = ", ".join(map(json.dumps, (text, within, selector)))
        r = await self.js(f"{RECT_JS}({args})")
        if not r:
            raise RuntimeError(f"no element shows {text!r}" + (f" in {within!r}" * bool(within)))
        return r

    async def capture(self, top: float, bottom: float, left: float = 0.0) -> Image.Image:
        """The page from `top` to `bottom` (page coordinates, CSS pixels), `left` to the
        window's right edge."""
        if bottom > self.height:
            raise RuntimeError(f"content ends at {bottom:.0f}px, below the window "
                               f"({self.height}px): raise TALL")
        clip = {"x": left, "y": top, "width": self.width - left, "height": bottom - top,
                "scale": 1}
        shot = await self.send("Page.captureScreenshot", format="png", clip=clip)
        return Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")

    async def header(self) -> tuple[float, float, float]:
        """(left, top, bottom) of the workflow's header: status, workflow id, run id,
        times and the tab bar, below the namespace bar."""
        main = await self.js("(() => { const r = document.querySelector('main')"
                             ".getBoundingClientRect(); return r.x; })()")
        back = await self.rect("Back to Workflows")
        tabs = await self.rect("User Metadata", within="Event History")
        return float(main or 0), back["y"] - 16, tabs["y"] + tabs["height"] + 12

    async def text_bottom(self, box: dict[str, float]) -> float:
        """The lowest text inside `box` (an empty end of a pane is cut off)."""
        return float(await self.js(f"""(() => {{ const b = {json.dumps(box)};
            let low = b.y;
            for (const e of document.querySelectorAll('main *')) {{
                if (e.children.length || !(e.textContent || '').trim()) continue;
                const r = e.getBoundingClientRect(), y = r.bottom + scrollY;
                if (r.width && r.x >= b.x && r.right <= b.x + b.width + 1 && r.y + scrollY
                    >= b.y && y <= b.y + b.height + 1) low = Math.max(low, y);
            }}
            return low; }})()"""))


def stack(parts: list[Image.Image]) -> Image.Image:
    """Crops of one page, top to bottom, a grey rule where page content was cut out."""
    width = max(p.width for p in parts)
    out = Image.new("RGB", (width, sum(p.height for p in parts) + 3 * (len(parts) - 1)),
                    (190, 190, 190))
    y = 0
    for p in parts:
        out.paste(p, (0, y))
        y += p.height + 3
    return out


def save_png(img: Image.Image, path: str) -> None:
    """Save under MAX_BYTES: a 256-colour palette first (UI text stays sharp), then
    smaller if it must."""
    scale = 1.0
    while True:
        out = img if scale == 1.0 else img.resize(
            (int(img.width * scale), int(img.height * scale)), Image.LANCZOS)
        buf = io.BytesIO()
        out.quantize(256, dither=Image.Dither.NONE).save(buf, "PNG", optimize=True)
        if buf.tell() <= MAX_BYTES or scale < 0.5:
            break
        scale *= 0.9
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    say(f"wrote {path}: {out.width}×{out.height}, {buf.tell() // 1024} KB")


@asynccontextmanager
async def chromium(work_dir: str):
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if not binary:
        raise SystemExit("chromium not found: apt-get install -y chromium")
    port = free_port()
    profile = tempfile.mkdtemp(prefix="chromium-", dir=work_dir)
    log = open(os.path.join(work_dir, "chromium.log"), "ab")
    proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--remote-debugging-port={port}",
                             f"--user-data-dir={profile}", "about:blank"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(port, proc, 60, "chromium", log.name)
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                tabs = await (await http.get(f"http://127.0.0.1:{port}/json/list")).json()
                tabs = [t for t in tabs if t.get("type") == "page"]
                if tabs:
                    break
                await asyncio.sleep(0.2)
            async with http.ws_connect(tabs[0]["webSocketDebuggerUrl"],
                                       max_msg_size=0) as ws:
                page = Page(ws)
                await page.send("Page.enable")
                await page.send("Runtime.enable")
                await page.viewport(WIDTH)
                yield page
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


# ---- the shots ------------------------------------------------------------------------
def workflow_url(ui: str, run_id: str, execution: str = "", tab: str = "") -> str:
    url = f"{ui}/namespaces/default/workflows/{run_id}"
    return url + (f"/{execution}" if execution else "") + (f"/{tab}" if tab else "")


async def section(page: Page, url: str, until: str, heading: str = "", head: bool = False,
                  bottom: tuple[str, str] | None = None,
                  clicks: tuple[tuple[str, str], ...] = (), then: str = "",
                  settle_s: float = 4.0) -> list[Image.Image]:
    """Crops of one page, once its text shows `until`: the header when `head`, then the
    page from `heading` (an h2; right under the tab bar when "") down to the bottom of
    `bottom` (text, within: see RECT_JS; the heading's pane's lowest text when None),
    after `clicks` (text, selector) and, with `then`, once the page shows `then`. A
    section below the Input/Result panes leaves them out."""
    say(f"shooting {url}")
    await page.goto(url, until=until, settle_s=settle_s)
    for text, selector in clicks:
        await page.click(text, selector)
    if then:  # what the clicks bring up
        await page.wait_text(then, 60)
        await asyncio.sleep(settle_s)
    left, head_top, head_bottom = await page.header()
    top = (await page.rect(heading, selector="main h2"))["y"] - 16 if heading else head_bottom
    if bottom:
        b = await page.rect(*bottom)
        low = b["y"] + b["height"]
    else:
        low = await page.text_bottom(await page.rect(heading, within=until,
                                                     selector="main h2"))
    if not head:
        return [await page.capture(top, low + 16, left)]
    if not heading:
        return [await page.capture(head_top, low + 16, left)]
    return [await page.capture(head_top, head_bottom, left),
            await page.capture(top, low + 16, left)]


async def shoot(client, ui: str, run_id: str, work_dir: str,
                out_dir: str) -> None:
    runs = await chain(client, run_id)
    last, faulted = runs[-1].run_id, await faulted_execution(client, run_id)
    say(f"chain of {len(runs)} executions; latest {last}, faulted {faulted}")
    async with chromium(work_dir) as page:
        # (a) the completed run's memo: the headline the run leaves behind
        parts = await section(page, workflow_url(ui, run_id, last, "memo"),
                              until='"headline"', heading="", head=True,
                              bottom=('"total_steps"', "Memo"))
        save_png(stack(parts), os.path.join(out_dir, "temporal-ui-memo.png"))
        # (b) the timelines of the chain's executions from the faulted one on: one bar per
        #     activity, its summary beside it, a retried one red where an attempt failed
        parts = []
        for wf in runs[[r.run_id for r in runs].index(faulted):][:3]:
            parts += await section(page, workflow_url(ui, run_id, wf.run_id, "timeline"),
                                   until="train_segment", heading="Timeline", head=True)
        save_png(stack(parts), os.path.join(out_dir, "temporal-ui-timeline.png"))
        # (c) the faulted execution's event history, compact, the faulted segment opened:
        #     its attempt 2 and the failure of attempt 1 (the killed worker's heartbeat)
        parts = await section(page, workflow_url(ui, run_id, faulted, "history"),
                              until="Activity Task Started", heading="Event History",
                              head=True, bottom=("Last Failure", "Activity Task Started"),
                              clicks=(("Compact", "button, a, label"),
                                      (r"train_segment[\s\S]*Attempt\s+([2-9]|\d\d)", "tr")))
        save_png(stack(parts), os.path.join(out_dir, "temporal-ui-history.png"))


async def shoot_live(page: Page, client, ui: str, run_id: str, demo: asyncio.Future,
                     work_dir: str, out_dir: str) -> bool:
    """Once a fault was recovered and a later segment trains (the memo: faults recovered,
    stage `train`, a step past 0), the run's User Metadata: the static summary and
    details, and Current Details — which the UI shows only while the run is open (it asks
    the worker with a query) — with the headline and what runs now."""
    while not demo.done():
        execution, m = await memo(client, run_id)
        if execution and m.get("faults_recovered", 0) >= 1 and m.get("stage") == "train" \
                and 0 < m.get("step", 0) < m.get("total_steps", 0):
            break
        await asyncio.sleep(0.5)
    else:
        say("the run ended before a later segment was seen: no live shot")
        return False
    try:
        parts = await section(page, workflow_url(ui, run_id, execution), until="User Metadata",
                              clicks=(("User Metadata", "a"),), then="stages done",
                              heading="", head=True, bottom=("Current Details", "Summary"),
                              settle_s=1.0)
        save_png(stack(parts), os.path.join(out_dir, "temporal-ui-faulted-run.png"))
        return True
    except Exception as exc:  # noqa: BLE001 - the run goes on; the other shots still come
        status = (await client.get_workflow_handle(run_id, run_id=execution).describe()).status
        say(f"no live shot ({exc!r}); the execution is now {status.name}")
        with open(os.path.join(work_dir, "live-page.txt"), "w") as f:
            f.write(await page.js("location.href + '\\n' + document.body.innerText"))
        await page.capture(0, HEIGHT).save(os.path.join(work_dir, "live-page.png"))
        return False


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DOCS, help="where the PNGs go (default: docs/)")
    ap.add_argument("--state-dir", default="", help="default: a fresh temporary directory")
    ap.add_argument("--serve", action="store_true", help="keep the server up at the end")
    ap.add_argument("--ui", default="", help="shoot a run on this UI (with --address, --run-id)")
    ap.add_argument("--address", default="")
    ap.add_argument("--run-id", default="")
    args = ap.parse_args()
    # SIGTERM (and Ctrl-C) end the run, the workers and the server cleanly
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    work = os.path.abspath(args.state_dir or tempfile.mkdtemp(prefix="mainspring-ui-"))
    os.makedirs(work, exist_ok=True)
    say(f"state (server, store, worker logs): {work}"
        + ("" if args.state_dir else ", removed at the end"))
    if args.ui:  # shoot again, run nothing
        try:
            client = await connect(args.address)
            await shoot(client, args.ui.rstrip("/"), args.run_id, work, args.out)
            return 0
        finally:
            if not args.state_dir:
                shutil.rmtree(work, ignore_errors=True)
    server = TemporalDevServer(os.path.join(work, "temporal"), port=free_port(),
                               ui_port=free_port()).start()
    try:
        wait_for_port(server.ui_port, server.proc, 60, "temporal web ui",
                      os.path.join(work, "temporal", "temporal.log"))
        say(f"Temporal UI {server.ui_url}, gRPC {server.address}")
        client = await connect(server.address)
        demo_preset = ops.demo.preset  # run_demo as it is, on the preset with the overrides
        ops.demo.preset = lambda name, **kw: demo_preset(name, **{**DEMO_OVERRIDES, **kw})
        async with chromium(work) as page:  # open before the run: the live moment is short
            await page.goto(f"{server.ui_url}/namespaces/default/workflows", until="Workflows")
            demo = asyncio.ensure_future(run_demo(True, server.address, work))
            run_id = await find_run_id(client)
            say(f"run {run_id}: {workflow_url(server.ui_url, run_id)}")
            live = await shoot_live(page, client, server.ui_url, run_id, demo, work, args.out)
        code = await demo
        if code != 0:
            say(f"the demo run did not complete (exit {code}); shooting what there is")
        await shoot(client, server.ui_url, run_id, work, args.out)
        if args.serve:
            say(f"serving {server.ui_url} (gRPC {server.address}); SIGTERM or Ctrl-C ends it")
            while True:
                await asyncio.sleep(3600)
        return 0 if code == 0 and live else 1
    finally:
        server.stop()
        if not args.state_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.exit(130)
