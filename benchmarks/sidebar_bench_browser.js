/**
 * Browser side of benchmarks/sidebar_bench.py (run by it; Playwright comes from tests/ui/node_modules).
 *
 *   node sidebar_bench_browser.js render URL KERNELS POLLS   -> JSON line: render/update times (ms)
 *   node sidebar_bench_browser.js tabs URL TABS SECONDS      -> phase lines the driver times CPU between
 *
 * render: one tab; the status route answers with KERNELS synthetic kernels on 2 GPUs whose usage moves on
 * every poll (so every update changes every bar); the panel's own render is timed, with and without the
 * style and layout work the browser does before the next frame.
 * tabs: TABS tabs of the real server (with the ledger the driver filled), first with the panel closed
 * (JupyterLab's own polling only), then with the panel open in every tab.
 */
const path = require('path');
const { chromium } = require(require.resolve('@playwright/test', {
  paths: [path.resolve(__dirname, '..', 'tests', 'ui')]
}));

const PANEL_ID = 'gpu-quota-ext-panel';
const GiB = 1024 ** 3;
const BROWSER = require(path.resolve(__dirname, '..', 'tests', 'ui', 'chromium.js'));

function say(line) {
  process.stdout.write(line + '\n');
}

function median(values) {
  const s = [...values].sort((a, b) => a - b);
  return s.length ? s[Math.floor((s.length - 1) / 2)] : NaN;
}

function pct(values, p) {
  const s = [...values].sort((a, b) => a - b);
  return s.length ? s[Math.min(s.length - 1, Math.round(p * (s.length - 1)))] : NaN;
}

/** A status reply with `n` kernels whose usage changes on every call. */
function makeStatus(n, tick) {
  const kernels = [];
  for (let i = 0; i < n; i++) {
    const cap = (10 + (i % 4) * 5) * GiB;
    const used = Math.round(cap * ((Math.sin(i * 0.7 + tick * 0.3) + 1) / 2) * 0.98);
    kernels.push({
      id: `bench-${String(i).padStart(4, '0')}-0000-4000-8000-000000000000`,
      user: 'bench',
      kernelspec: i % 5 ? 'python3' : 'pytorch',
      path: `project-${i % 7}/notebook-${i}.ipynb`,
      source: 'default',
      placed: true,
      cpu_only_reason: null,
      devices: [
        { index: i % 2, cap, max_cap: 80 * GiB, policy_cap: 20 * GiB, used, allocated: used * 0.7, reserved: used * 0.8, peak: used }
      ],
      last_action:
        i % 10 === 0
          ? { time: Date.now() / 1000 - 30, action: 'warn', device: i % 2, used, cap }
          : null
    });
  }
  return {
    gpu: true,
    message: null,
    user: 'bench',
    devices: [0, 1].map(index => ({
      index,
      name: `Bench GPU ${index}`,
      uuid: `bench-${index}`,
      total: 80 * GiB,
      budget: null,
      granted: 1000 * GiB,
      kernels: n / 2,
      used: (40 + tick % 10) * GiB
    })),
    kernels,
    policy: {}
  };
}

async function openLab(context, url, workspace) {
  const page = await context.newPage();
  // Each tab its own fresh workspace: none restores a panel another tab left open.
  await page.goto(`${url}/lab/workspaces/${workspace}?reset`);
  await page.waitForFunction(
    id => window.jupyterapp && window.jupyterapp.shell && Array.from(window.jupyterapp.shell.widgets('left')).some(w => w.id === id),
    PANEL_ID,
    { timeout: 120000 }
  );
  await page.evaluate(() => window.jupyterapp.restored);
  return page;
}

async function render(url, kernels, polls) {
  const browser = await chromium.launch(BROWSER);
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  let tick = 0;
  await context.route(/\/api\/gpu-quota\/status/, route =>
    route.fulfill({ json: makeStatus(kernels, tick++) })
  );
  const page = await openLab(context, url, 'bench-render');
  const result = await page.evaluate(
    async ({ id, kernels, polls }) => {
      const app = window.jupyterapp;
      const panel = Array.from(app.shell.widgets('left')).find(w => w.id === id);
      const model = panel._model;
      const frame = () => new Promise(r => requestAnimationFrame(() => r()));
      panel.renderTimes.length = 0;
      app.shell.activateById(id);
      // First render with every kernel: rows created.
      const t0 = performance.now();
      while (panel.node.querySelectorAll('li.jp-GpuQuota-kernel').length < kernels) {
        await frame();
        if (performance.now() - t0 > 30000) throw new Error('rows never appeared: ' + JSON.stringify({ phase: model.state.phase, error: model.state.error, visible: panel.isVisible, n: model.state.status && model.state.status.kernels.length, text: panel.node.textContent.slice(0, 300) }));
      }
      const firstScript = Math.max(...panel.renderTimes);
      // First render again, timed with layout: drop the rows, render, force layout.
      panel._kernelRows.forEach(r => r.node.remove());
      panel._kernelRows.clear();
      let s = performance.now();
      panel.renderNow();
      void panel.node.lastElementChild.getBoundingClientRect().height;
      const firstWithLayout = performance.now() - s;
      await frame();
      const script = [];
      const withLayout = [];
      for (let i = 0; i < polls; i++) {
        await model.refresh(); // a poll: new figures for every kernel
        s = performance.now();
        const scriptOnly = panel.renderNow();
        void panel.node.lastElementChild.getBoundingClientRect().height; // style + layout, as before a frame
        withLayout.push(performance.now() - s);
        script.push(scriptOnly);
        await frame();
        await frame();
      }
      return { firstScript, firstWithLayout, script, withLayout, rows: panel.node.querySelectorAll('li.jp-GpuQuota-kernel').length };
    },
    { id: PANEL_ID, kernels, polls }
  );
  await browser.close();
  say(
    JSON.stringify({
      kernels,
      polls,
      rows: result.rows,
      first_render_script_ms: result.firstScript,
      first_render_with_layout_ms: result.firstWithLayout,
      update_script_ms_median: median(result.script),
      update_script_ms_p95: pct(result.script, 0.95),
      update_with_layout_ms_median: median(result.withLayout),
      update_with_layout_ms_p95: pct(result.withLayout, 0.95)
    })
  );
}

async function tabs(url, count, seconds) {
  const browser = await chromium.launch(BROWSER);
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  let statusRequests = 0;
  context.on('request', r => {
    if (r.url().includes('/api/gpu-quota/status')) statusRequests++;
  });
  const pages = [];
  for (let i = 0; i < count; i++) {
    pages.push(await openLab(context, url, `bench-tab-${i}`));
  }
  const sleep = ms => new Promise(r => setTimeout(r, ms));
  await sleep(5000);
  say(`BASELINE_START ${statusRequests}`);
  await sleep(seconds * 1000);
  say(`BASELINE_END ${statusRequests}`);
  for (const page of pages) {
    await page.evaluate(id => window.jupyterapp.shell.activateById(id), PANEL_ID);
  }
  await sleep(3000);
  say(`PANEL_START ${statusRequests}`);
  await sleep(seconds * 1000);
  say(`PANEL_END ${statusRequests}`);
  const rows = await pages[0].evaluate(() => document.querySelectorAll('li.jp-GpuQuota-kernel').length);
  say(`ROWS ${rows}`);
  await browser.close();
}

const [mode, url, a, b] = process.argv.slice(2);
(mode === 'render' ? render(url, Number(a || 200), Number(b || 50)) : tabs(url, Number(a || 10), Number(b || 30))).catch(
  error => {
    console.error(error);
    process.exit(1);
  }
);
