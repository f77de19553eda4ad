/**
 * The GPU quota sidebar and status bar in a real Chromium, against a real `jupyter lab` with the
 * extension and two static 80 GiB GPUs (see ../jupyter_server_test_config.py). Default cap: 0.25,
 * so a new kernel holds 20 GiB on one GPU. The fake NVML sees no process: every usage is 0, and known.
 */
import { expect, test } from '@jupyterlab/galata';

import { newNotebook, openPanel, PANEL, POLL_MS, row, runInNotebook, STATUS } from './helpers';

test.describe('GPU quota sidebar', () => {
  test('the tab opens and lists both GPUs', async ({ page }) => {
    await openPanel(page);
    const devices = page.locator(`${PANEL} .jp-GpuQuota-device`);
    await expect(devices).toHaveCount(2);
    await expect(devices.nth(0)).toContainText('Test GPU 0');
    await expect(devices.nth(1)).toContainText('Test GPU 1');
    await expect(devices.nth(0)).toContainText('/ 80 GiB');
    // The notebook toolbar shows nothing new.
    await expect(page.locator('.jp-NotebookPanel-toolbar .jp-GpuQuota-status')).toHaveCount(0);
  });

  test('two notebooks: their kernels appear with their caps, the current one first', async ({ page, tmpPath }) => {
    await openPanel(page);
    const a = await newNotebook(page, tmpPath, 'a.ipynb');
    const b = await newNotebook(page, tmpPath, 'b.ipynb');
    for (const [id, name] of [[a, 'a.ipynb'], [b, 'b.ipynb']]) {
      await expect(row(page, id)).toBeVisible();
      await expect(row(page, id).locator('.jp-GpuQuota-path')).toContainText(name);
      await expect(row(page, id).locator('.jp-GpuQuota-figure')).toHaveText('0 / 20 GiB');
      await expect(row(page, id).locator('.jp-GpuQuota-spec')).toHaveText('python3');
    }
    // b.ipynb is the active notebook: its kernel is on top and highlighted.
    const first = page.locator(`${PANEL} li.jp-GpuQuota-kernel`).first();
    await expect(first).toHaveAttribute('data-kernel-id', b);
    await expect(first).toHaveClass(/jp-mod-current/);
    await page.activity.activateTab('a.ipynb');
    await expect(first).toHaveAttribute('data-kernel-id', a);
    await expect(row(page, b)).not.toHaveClass(/jp-mod-current/);
  });

  test('a cap changed with %gpucap shows in the sidebar within one poll, and the status bar follows the active notebook', async ({
    page,
    tmpPath
  }) => {
    await openPanel(page);
    const a = await newNotebook(page, tmpPath, 'a.ipynb');
    const b = await newNotebook(page, tmpPath, 'b.ipynb');
    await expect(row(page, a).locator('.jp-GpuQuota-figure')).toHaveText('0 / 20 GiB');

    const output = await runInNotebook(page, 'a.ipynb', '%gpucap 0.3');
    const ranAt = Date.now();
    console.log(`%gpucap 0.3 printed: ${output.trim()}`);
    // 0.3 of 80 GiB = 24 GiB; the server is not told to refresh the sidebar: the next poll shows it.
    await expect(row(page, a).locator('.jp-GpuQuota-figure')).toHaveText('0 / 24 GiB', {
      timeout: POLL_MS + 1000
    });
    console.log(`sidebar showed the new cap ${Date.now() - ranAt} ms after the cell finished`);
    await expect(row(page, b).locator('.jp-GpuQuota-figure')).toHaveText('0 / 20 GiB');

    const status = page.locator(STATUS);
    await expect(status).toHaveText('GPU 0 / 24 GiB');
    await page.activity.activateTab('b.ipynb');
    await expect(status).toHaveText('GPU 0 / 20 GiB');
    await page.activity.activateTab('a.ipynb');
    await expect(status).toHaveText('GPU 0 / 24 GiB');
    await expect(status).toHaveAttribute('title', /no usage measured yet|NVML|allocator/);
  });

  test('a cap set from the panel goes through the API and its limits', async ({ page, tmpPath }) => {
    await openPanel(page);
    const a = await newNotebook(page, tmpPath, 'a.ipynb');
    const r = row(page, a);
    await r.locator('.jp-GpuQuota-capInput').fill('12GiB');
    await r.getByRole('button', { name: 'Set cap' }).click();
    await expect(r.locator('.jp-GpuQuota-feedback')).toContainText('Granted');
    await expect(r.locator('.jp-GpuQuota-figure')).toHaveText('0 / 12 GiB');
    await r.locator('.jp-GpuQuota-capInput').fill('lots');
    await r.getByRole('button', { name: 'Set cap' }).click();
    await expect(r.locator('.jp-GpuQuota-feedback')).toContainText("'lots' is not a cap");
    await expect(r.locator('.jp-GpuQuota-figure')).toHaveText('0 / 12 GiB');
    await r.getByRole('button', { name: 'Reset' }).click();
    await expect(r.locator('.jp-GpuQuota-figure')).toHaveText('0 / 20 GiB');
  });

  test('shutting a kernel down from the panel removes it', async ({ page, tmpPath }) => {
    await openPanel(page);
    const a = await newNotebook(page, tmpPath, 'a.ipynb');
    const b = await newNotebook(page, tmpPath, 'b.ipynb');
    await expect(row(page, a)).toBeVisible();
    await row(page, a).getByRole('button', { name: 'Shut down' }).click();
    await page.locator('.jp-Dialog').getByRole('button', { name: 'Shut Down' }).click();
    await expect(row(page, a)).toHaveCount(0);
    await expect(row(page, b)).toBeVisible();
    const kernels = await (await page.request.get('/api/kernels')).json();
    expect(kernels.map((k: any) => k.id)).not.toContain(a);
    // And it stays gone after the next polls (two answers of the status API, waited for, not timed).
    for (let poll = 0; poll < 2; poll++) {
      await page.waitForResponse(response => response.url().includes('/api/gpu-quota/status'));
    }
    await expect(row(page, a)).toHaveCount(0);
  });

  test('polling stands by while neither the panel nor the status bar needs it', async ({ page, tmpPath }) => {
    let requests = 0;
    page.on('request', request => {
      if (request.url().includes('/api/gpu-quota/status')) {
        requests += 1;
      }
    });
    // No notebook (the status bar item is hidden) and the panel closed.
    await page.waitForTimeout(POLL_MS * 2.5);
    requests = 0;
    await page.waitForTimeout(POLL_MS * 2.5);
    expect(requests).toBe(0);
    // A notebook opens, the panel still closed: the status bar needs figures, polling resumes.
    await newNotebook(page, tmpPath, 'a.ipynb');
    await expect(page.locator(STATUS)).toHaveText('GPU 0 / 20 GiB');
    await expect(page.locator(PANEL)).toBeHidden();
    // Two polls, waited for as requests (bounded by the test's timeout), not counted over a guessed time.
    for (let poll = 0; poll < 2; poll++) {
      await page.waitForRequest(request => request.url().includes('/api/gpu-quota/status'));
    }
  });
});

test.describe('GPU quota sidebar without a GPU or without the server extension', () => {
  test.use({ autoGoto: false });

  test('a server without the extension: one line says so', async ({ page }) => {
    await page.route(/\/api\/gpu-quota\/status/, route =>
      route.fulfill({ status: 404, json: { message: 'Not Found' } })
    );
    await page.goto();
    await openPanel(page);
    await expect(page.locator(`${PANEL} .jp-GpuQuota-message`)).toHaveText(
      'The gpu-quota-ext server extension is not enabled on this server.'
    );
    await expect(page.locator(`${PANEL} .jp-GpuQuota-device`)).toHaveCount(0);
  });

  test('a server without a GPU: one line says why in plain words, the driver\'s text on hover', async ({ page }) => {
    // What a server answers on a machine without an NVIDIA driver (tests/integration/test_reasons.py).
    const message = 'no GPU: NVML could not start (NVMLError_LibraryNotFound: NVML Shared Library Not Found)';
    await page.route(/\/api\/gpu-quota\/status/, route =>
      route.fulfill({
        json: {
          gpu: false,
          message,
          user: 'test',
          devices: [],
          kernels: [],
          policy: {},
          reasons: { no_gpu: { reason: 'no NVIDIA driver is loaded on this machine', detail: message }, monitor: null }
        }
      })
    );
    await page.goto();
    await openPanel(page);
    const line = page.locator(`${PANEL} .jp-GpuQuota-message`);
    await expect(line).toHaveText('No GPU on this server: no NVIDIA driver is loaded on this machine');
    await expect(line).toHaveAttribute('title', message);
  });

  test('an older server\'s raw message is shown as it is', async ({ page }) => {
    await page.route(/\/api\/gpu-quota\/status/, route =>
      route.fulfill({
        json: { gpu: false, message: 'no GPU: NVML library not found', user: 'test', devices: [], kernels: [], policy: {} }
      })
    );
    await page.goto();
    await openPanel(page);
    await expect(page.locator(`${PANEL} .jp-GpuQuota-message`)).toHaveText(
      'No GPU on this server: NVML library not found'
    );
  });
});
