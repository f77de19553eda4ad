/**
 * What a kernel row shows of its usage, against the real server of run.sh whose fake NVML and checkpoint
 * driver follow a scenario file (../ui_scenario.py): usage NVML cannot read shown as unknown (never as 0),
 * the chart of its usage over the last minutes with a park period marked (parked and resumed by the real
 * parker), one short reason per row with the raw text on hover, and every button whole at three sidebar
 * widths. Screenshots go to build/ui.
 */
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';

import {
  GiB,
  grantOf,
  kernelPid,
  newNotebook,
  openPanel,
  PANEL,
  reportAllocator,
  row,
  setScenario,
  setSidebarWidth,
  shot,
  SIDEBAR_WIDTHS,
  startKernel,
  STATUS,
  transitionsDone
} from './helpers';

test.describe('usage in a kernel row', () => {
  test.afterEach(async ({ page }) => {
    await setScenario(page, {}); // an idle GPU for the next test
  });

  test('usage NVML cannot read is shown as unknown, never as 0, and the banner says why', async ({
    page,
    tmpPath
  }) => {
    await openPanel(page);
    const a = await newNotebook(page, tmpPath, 'a.ipynb');
    const r = row(page, a);
    const bar = r.locator('.jp-GpuQuota-kernelDevice .jp-GpuQuota-bar');
    await expect(r.locator('.jp-GpuQuota-figure')).toHaveText('0 / 20 GiB'); // known, and 0
    await expect(bar).not.toHaveClass(/jp-mod-unknown/);

    await setScenario(page, { lost: ['static-0', 'static-1'] }); // NVML reads neither GPU any more
    await expect(r.locator('.jp-GpuQuota-figure')).toHaveText('unknown / 20 GiB');
    await expect(bar).toHaveClass(/jp-mod-unknown/);
    await expect(bar).toHaveAttribute('aria-valuetext', 'usage unknown');
    expect(await bar.getAttribute('aria-valuenow')).toBeNull();
    await expect(r.locator('.jp-GpuQuota-kernelDevice')).toHaveAttribute('title', /usage unknown, cap 20 GiB/);
    await expect(page.locator(STATUS)).toHaveText('GPU unknown / 20 GiB');
    const banner = page.locator(`${PANEL} .jp-GpuQuota-message`);
    await expect(banner).toHaveAttribute('data-monitor', 'error');
    await expect(banner).toHaveText('GPU usage cannot be read: a GPU is lost (off the bus or being reset)');
    await expect(banner).toHaveAttribute('title', /NVMLError_GpuIsLost/); // the driver's words on hover
    await transitionsDone(page);
    await page.locator(PANEL).screenshot({ path: shot('usage-unknown.png') });

    await setScenario(page, {}); // readable again
    await expect(r.locator('.jp-GpuQuota-figure')).toHaveText('0 / 20 GiB');
    await expect(bar).not.toHaveClass(/jp-mod-unknown/);
    await expect(banner).toBeHidden();
  });

  test('the chart follows NVML and the allocator against the cap, and marks a park period', async ({
    page,
    tmpPath
  }) => {
    await openPanel(page);
    const id = await newNotebook(page, tmpPath, 'train.ipynb');
    const pid = await kernelPid(page, 'train.ipynb');
    const grant = await grantOf(page, id);
    const r = row(page, id);
    await setScenario(page, { usage: { [pid]: { [grant.uuid]: 6 * GiB } } });
    await reportAllocator(page, id, grant.index, 4 * GiB, 5 * GiB);
    await expect(r.locator('.jp-GpuQuota-figure')).toHaveText('6 / 20 GiB');

    const chart = r.locator('.jp-GpuQuota-chart');
    await expect(chart).toBeVisible();
    await expect(page.locator(`${PANEL} .jp-GpuQuota-legend`)).toBeVisible();
    await expect(chart.locator('.jp-GpuQuota-chartUsed')).toHaveAttribute('d', /^M[\d.]+ [\d.]+L/); // 2+ points
    await expect(chart.locator('.jp-GpuQuota-chartAllocated')).toHaveAttribute('d', /Z$/);
    await expect(chart.locator('.jp-GpuQuota-chartReserved')).toHaveAttribute('d', /Z$/);
    await expect(chart.locator('.jp-GpuQuota-chartCap')).toHaveAttribute('d', /^M/);
    await expect(chart.locator('.jp-GpuQuota-chartHardLimit')).toHaveAttribute('d', ''); // hard limits off
    await expect(chart).toHaveAttribute('title', /NVML used \(line\): 6 GiB now/);
    await expect(chart).toHaveAttribute('title', /4 GiB allocated, 5 GiB reserved/);
    await expect(chart).toHaveAttribute('title', /Cap \(dashed\): 20 GiB/);
    await expect(chart.locator('.jp-GpuQuota-chartUnknown')).toBeHidden();

    // Parked by the server's parker (the fake driver moves its 6 GiB to the host), then resumed.
    await r.getByRole('button', { name: 'Park' }).click();
    await expect(r.locator('.jp-GpuQuota-line')).toHaveText(/^parked since \d\d:\d\d, 6 GiB on host$/, {
      timeout: 30000
    });
    await expect(chart.locator('.jp-GpuQuota-chartPark')).toHaveCount(1);
    await expect(chart).toHaveAttribute('title', /Parked: \d\d:\d\d–\d\d:\d\d/);
    await expect(r.locator('.jp-GpuQuota-figure')).toHaveText('0 / 20 GiB'); // NVML sees nothing while parked
    await transitionsDone(page);
    await r.screenshot({ path: shot('row-parked.png') });
    await r.getByRole('button', { name: 'Resume' }).click();
    await expect(r.locator('.jp-GpuQuota-figure')).toHaveText('6 / 20 GiB', { timeout: 30000 });
    await expect(r.locator('.jp-GpuQuota-line')).toHaveText(/^(idle|running)/);
    await expect(chart.locator('.jp-GpuQuota-chartPark')).toHaveCount(1); // the period stays marked
  });

  test('one short reason per row, the raw text on hover', async ({ page }) => {
    const kernelId = await startKernel(page);
    try {
      await openPanel(page);
      const r = row(page, kernelId);
      const line = r.locator('.jp-GpuQuota-line');
      // The real server's reason: the fake NVML sees no memory for this kernel.
      await expect(line).toHaveText('Not parkable: it holds no GPU memory');
      await expect(line).toHaveAttribute('title', 'this kernel holds no GPU memory');

      // The reason a server on a machine without an NVIDIA driver gives every kernel, as it sends it
      // (tests/integration/test_reasons.py), put into the real answer here: this server has a (fake) driver.
      const raw =
        'no checkpoint driver: no CUDA driver here (libcuda.so.1 cannot be loaded: libcuda.so.1: cannot open ' +
        'shared object file: No such file or directory)';
      await page.route(/\/api\/gpu-quota\/status/, async route => {
        const response = await route.fetch();
        const body = await response.json();
        for (const kernel of body.kernels) {
          kernel.park = { ...kernel.park, parkable: false, reason: raw };
          kernel.reasons = { ...kernel.reasons, park: { reason: 'no NVIDIA driver is loaded on this machine', detail: raw } };
        }
        await route.fulfill({ response, json: body });
      });
      await expect(line).toHaveText('Not parkable: no NVIDIA driver is loaded on this machine');
      await expect(line).toHaveAttribute('title', raw);
      expect(await r.innerText()).not.toContain('libcuda');
      // One short reason: at most two lines of text at the default width, however long the detail.
      const height = (await line.boundingBox())!.height;
      const lineHeight = await line.evaluate(node => parseFloat(getComputedStyle(node).lineHeight) || 16);
      expect(height).toBeLessThan(lineHeight * 2.5);
    } finally {
      await page.request.delete(`/api/kernels/${kernelId}`);
    }
  });

  test('every button shows in full at three sidebar widths', async ({ page, tmpPath }) => {
    await openPanel(page);
    const id = await newNotebook(page, tmpPath, 'a-notebook-with-a-long-name.ipynb');
    const r = row(page, id);
    await expect(r).toBeVisible();
    // JupyterLab opens the sidebar at 250 px, which is also the narrowest it lets a user drag it to.
    const opened = Math.round((await page.locator(PANEL).boundingBox())!.width);
    expect(opened).toBe(SIDEBAR_WIDTHS.default);
    for (const [label, wanted] of Object.entries(SIDEBAR_WIDTHS)) {
      const width = await setSidebarWidth(page, wanted);
      expect(Math.abs(width - wanted), `the sidebar at ${wanted} px`).toBeLessThanOrEqual(2);
      await expectWhole(page, id);
      await transitionsDone(page);
      await page.locator(PANEL).screenshot({ path: shot(`sidebar-${label}.png`) });
      console.log(`${label}: ${width} px`);
    }
  });
});

/** Every visible control of the row lies inside the panel and shows its whole label. */
async function expectWhole(page: IJupyterLabPageFixture, kernelId: string): Promise<void> {
  const panel = (await page.locator(PANEL).boundingBox())!;
  const controls = row(page, kernelId).locator('button:visible, input:visible');
  const count = await controls.count();
  expect(count).toBeGreaterThanOrEqual(4); // Set cap, Reset, Park, Shut down (and the cap field)
  for (let i = 0; i < count; i++) {
    const control = controls.nth(i);
    const box = (await control.boundingBox())!;
    const name = (await control.textContent()) || (await control.getAttribute('aria-label'));
    expect(box.x, `${name}: left edge in the panel`).toBeGreaterThanOrEqual(panel.x);
    expect(box.x + box.width, `${name}: right edge in the panel`).toBeLessThanOrEqual(panel.x + panel.width + 0.5);
    const cut = await control.evaluate(node => node.scrollWidth > node.clientWidth + 1);
    expect(cut, `${name}: its label is cut`).toBe(false);
  }
}
