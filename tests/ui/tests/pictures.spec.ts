/**
 * The pictures of docs/images, made on purpose by `./run pictures` (run.sh --pictures), never by the tests.
 *
 * They are what the home page, the README and the user guide show a reader first, so they show a healthy
 * server: every kernel under its cap, no GPU lost, no warning. The server is the demo's
 * (binder/jupyter_server_config.py: two simulated GPUs of 80 and 40 GiB, a quarter of a GPU per kernel) with
 * the scenario's fake NVML and checkpoint driver (../ui_scenario.py), sampling every 0.25 s so that a minute
 * and a quarter fills a chart's 300 samples. Five notebooks, as a user opens them: a training run whose usage
 * climbs towards (not past) its cap, a fine-tune, one parked from the sidebar, two smaller ones; under the
 * training notebook's cell, its `%gpucap panel` with the chart of its usage history. Then, for the one picture
 * that shows trouble on purpose (sidebar-trouble-light.png, where the sidebar guide says what goes wrong), a
 * kernel past its cap, a resume that waits for device memory and a GPU that NVML cannot read. Every figure comes from
 * the real server; only what NVML and the checkpoint driver report is the scenario's. Before each healthy picture
 * the spec checks that the panel and the status bar show no error or warning (expectHealthy), so that a change
 * of the scenario or of the server cannot put one in the docs unseen. Time passes by the server's own samples
 * (waited for in its history), never by sleeping.
 */
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import type { Page } from '@playwright/test';

import {
  GiB,
  newNotebookKernel,
  openPanel,
  PANEL,
  reportAllocator,
  row,
  setScenario,
  setSidebarWidth,
  shot,
  SIDEBAR_WIDTHS,
  STATUS,
  transitionsDone
} from './helpers';
import type { IKernel } from './helpers';

test.use({ viewport: { width: 1280, height: 1200 } });

/** Until the server has taken `samples` more samples of kernel `id`: its history's newest point that much later. */
async function samplesPass(page: IJupyterLabPageFixture, id: string, samples: number): Promise<void> {
  const newest = async () => {
    const history = await (await page.request.get(`/api/gpu-quota/kernels/${id}/history`)).json();
    const points = history.points as { t: number }[];
    return { t: points.length ? points[points.length - 1].t : 0, interval: history.interval as number };
  };
  const start = await newest();
  const wanted = start.t + (samples - 0.5) * start.interval;
  await expect.poll(async () => (await newest()).t, { timeout: 120000, intervals: [250] }).toBeGreaterThanOrEqual(
    wanted
  );
}

const TRAINING_CELL = [
  'for epoch in range(epochs):',
  '    for batch in loader:',
  '        loss = model(batch.to("cuda")).loss',
  '        loss.backward()',
  '        optimizer.step()',
  '        optimizer.zero_grad()'
].join('\n');

/**
 * What a picture of a healthy server must not show: the panel's banner (a GPU that cannot be read, a stalled
 * monitor, a server that does not answer), a figure, line or bar at the warning or over level (a kernel near
 * or past its cap, a resume that waits, a lost kernel), usage unknown, a watchdog action, or the status bar
 * in its warning or stalled colour.
 */
async function expectHealthy(page: Page): Promise<void> {
  const panel = page.locator(PANEL);
  await expect(panel.locator('.jp-GpuQuota-message')).toBeHidden();
  await expect(panel.locator('.jp-mod-warning:visible, .jp-mod-over:visible')).toHaveCount(0);
  await expect(panel.locator('.jp-mod-unknown:visible')).toHaveCount(0);
  await expect(panel.locator('.jp-GpuQuota-action:visible')).toHaveCount(0);
  await expect(page.locator(`${STATUS}.jp-mod-warning, ${STATUS}.jp-mod-stalled`)).toHaveCount(0);
}

test('the pictures of docs/images', async ({ page, tmpPath }) => {
  await openPanel(page);
  // Started one after the other, "spread" placement puts them on GPU 0, 1, 0, 1, 0 (the least granted).
  const names = ['train.ipynb', 'finetune.ipynb', 'explore.ipynb', 'notes.ipynb', 'eval.ipynb'];
  const kernels: Record<string, IKernel> = {};
  for (const name of names) {
    kernels[name] = await newNotebookKernel(page, tmpPath, name);
  }
  expect(names.map(n => kernels[n].index)).toEqual([0, 1, 0, 1, 0]);
  expect(new Set(names.map(n => kernels[n].pid)).size).toBe(names.length);
  const [train, finetune, explore, notes, evaluation] = names.map(n => kernels[n]);
  const gpu1 = finetune.uuid;

  // The caps: 20 GiB on GPU 0, 10 GiB on GPU 1. Every kernel stays below 90% of its cap (the warning level).
  const usage = (trainBytes: number, finetuneBytes: number) => ({
    [train.pid]: { [train.uuid]: trainBytes },
    [finetune.pid]: { [finetune.uuid]: finetuneBytes },
    [explore.pid]: { [explore.uuid]: 6 * GiB },
    [notes.pid]: { [notes.uuid]: 1.2 * GiB },
    [evaluation.pid]: { [evaluation.uuid]: 4 * GiB }
  });
  const allocator = async (kernel: IKernel, allocated: number, reserved: number) =>
    reportAllocator(page, kernel.id, kernel.index, allocated, reserved);
  const others = { [gpu1]: 0.5 * GiB }; // a process outside this server, as on a shared machine

  // What NVML and the kernels' allocators say as the minute goes by.
  await setScenario(page, { usage: usage(3 * GiB, 5.2 * GiB), other_used: others });
  await allocator(train, 2.2 * GiB, 2.5 * GiB);
  await allocator(finetune, 4.4 * GiB, 4.7 * GiB);
  await allocator(explore, 5.1 * GiB, 5.4 * GiB);
  await allocator(evaluation, 3.1 * GiB, 3.4 * GiB);
  await samplesPass(page, train.id, 24);

  for (const [step, gib] of [4.5, 6, 7.5, 9, 10.5, 11.2].entries()) {
    const finetuneGib = Math.min(5.2 + 0.4 * step, 6.4);
    await setScenario(page, { usage: usage(gib * GiB, finetuneGib * GiB), other_used: others });
    await samplesPass(page, train.id, 2); // the fakes have read the new scenario
    await allocator(train, (gib - 0.8) * GiB, (gib - 0.5) * GiB);
    await allocator(finetune, (finetuneGib - 0.8) * GiB, (finetuneGib - 0.5) * GiB);
    if (step === 1) {
      // Explore is done for now: parked from the sidebar, its GPU memory on the host until it is asked back.
      await row(page, explore.id).getByRole('button', { name: 'Park' }).click();
    }
    await samplesPass(page, train.id, 26);
  }
  await expect(row(page, explore.id).locator('.jp-GpuQuota-line')).toHaveText(/^parked since/);
  await expect(row(page, finetune.id).locator('.jp-GpuQuota-figure')).toHaveText('6.4 / 10 GiB');
  await samplesPass(page, train.id, 30);

  // The training notebook in front, showing code rather than the cell that asked for its PID.
  await page.activity.activateTab('train.ipynb');
  await page.evaluate(async source => {
    const app = (window as any).jupyterapp;
    // Into the cell's model, as a file would have it (typing it in would indent each line twice).
    app.shell.currentWidget.content.widgets[0].model.sharedModel.setSource(source);
    await app.commands.execute('notebook:clear-all-cell-outputs');
  }, TRAINING_CELL);
  await expect(page.locator(STATUS)).toHaveText('GPU 11.2 / 20 GiB');
  // Under the training cell, `%gpucap panel`: its bars (the demo's torch reads no GPU) and the chart of the
  // kernel's usage history, which the kernel reads from the server.
  if ((await page.notebook.getCellCount()) > 1) {
    await page.notebook.setCell(1, 'code', '%gpucap panel'); // the empty cell that running cell 0 left
  } else {
    await page.notebook.addCell('code', '%gpucap panel');
  }
  await page.notebook.runCell(1);
  const usagePanel = (await page.notebook.getCellOutputLocator(1))!;
  await expect(usagePanel.locator('svg.gpu-quota-chart')).toBeVisible({ timeout: 30000 });
  await expect(usagePanel.locator('svg.gpu-quota-chart path.gpu-quota-chart-used')).toHaveCount(1);
  const panel = page.locator(PANEL);
  for (const theme of ['light', 'dark']) {
    if (theme === 'dark') {
      await page.theme.setDarkTheme();
    }
    for (const [label, width] of Object.entries(SIDEBAR_WIDTHS)) {
      expect(await setSidebarWidth(page, width)).toBe(width);
      await panel.evaluate(node => node.scrollTo(0, 0));
      await transitionsDone(page);
      await expectHealthy(page);
      const name = label === 'default' ? `sidebar-${theme}.png` : `sidebar-${label}-${theme}.png`;
      await panel.screenshot({ path: shot(name) });
    }
    expect(await setSidebarWidth(page, SIDEBAR_WIDTHS.default)).toBe(SIDEBAR_WIDTHS.default);
    await transitionsDone(page);
    await expectHealthy(page);
    await page.screenshot({ path: shot(`lab-${theme}.png`) });
    await usagePanel.screenshot({ path: shot(`panel-${theme}.png`) });
  }

  // One picture of what goes wrong, on purpose, for the sidebar guide's paragraph on it (sidebar-trouble-light.png):
  // the fine-tune goes past its cap (the watchdog warns), the eval notebook is parked and asked back while processes
  // outside this server hold most of GPU 0 (the broker has no room for it and no kernel idle long enough to park:
  // the config's park_min_idle, so it waits, saying for how long and what for), then GPU 1 stops answering NVML
  // (the notes notebook, which reported no allocator figures, is unknown; the banner says which GPU).
  await page.theme.setLightTheme();
  await row(page, evaluation.id).getByRole('button', { name: 'Park' }).click();
  await expect(row(page, evaluation.id).locator('.jp-GpuQuota-line')).toHaveText(/^parked since/, {
    timeout: 30000
  });
  // GPU 0 (80 GiB): 66 GiB held outside this server and the training run's 11.2 leave less than eval's 4 GiB.
  const crowded = { [train.uuid]: 66 * GiB, [gpu1]: 0.5 * GiB };
  await setScenario(page, { usage: usage(11.2 * GiB, 11.2 * GiB), other_used: crowded });
  await samplesPass(page, train.id, 2);
  await allocator(finetune, 8.8 * GiB, 9.3 * GiB); // NVML counts 11.2 GiB: its context, and CuPy
  await row(page, evaluation.id).getByRole('button', { name: 'Resume' }).click();
  await samplesPass(page, train.id, 40);
  await expect(row(page, evaluation.id).locator('.jp-GpuQuota-line')).toHaveText(
    /^waiting for device memory for \d+ s \(limit 5 min\): needs 4\.0 GiB on GPU 0$/
  );
  await expect(row(page, finetune.id).locator('.jp-GpuQuota-action')).toContainText('Watchdog: warn');
  await setScenario(page, { usage: usage(11.2 * GiB, 11.2 * GiB), other_used: crowded, lost: [gpu1] });
  await expect(row(page, notes.id).locator('.jp-GpuQuota-figure')).toHaveText('unknown / 10 GiB');
  await expect(panel.locator('.jp-GpuQuota-message')).toHaveText(/^Some GPUs cannot be read/);
  await samplesPass(page, train.id, 12);
  await panel.evaluate(node => node.scrollTo(0, 0));
  await transitionsDone(page);
  await panel.screenshot({ path: shot('sidebar-trouble-light.png') });
});
