/**
 * The GPU quota sidebar and status bar in a real Chromium, against a real `jupyter lab` with the
 * extension and two static 80 GiB GPUs (see ../jupyter_server_test_config.py). Default cap: 0.25,
 * so a new kernel holds 20 GiB on one GPU.
 */
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import type { Page, Route } from '@playwright/test';
import * as path from 'path';

const PANEL_ID = 'gpu-quota-ext-panel';
const PANEL = `#${PANEL_ID}`;
const STATUS = '.jp-GpuQuota-status';
const GiB = 1024 ** 3;
const POLL_MS = 2000; // the schema's default refreshInterval
const IMAGES = path.resolve(__dirname, '..', '..', '..', 'docs', 'images');

async function openPanel(page: IJupyterLabPageFixture): Promise<void> {
  await page.sidebar.openTab(PANEL_ID);
  await expect(page.locator(PANEL)).toBeVisible();
}

/** The kernel of the notebook whose path ends with `name`, from the sessions API. */
async function kernelOf(page: Page, name: string): Promise<string> {
  let id = '';
  await expect(async () => {
    const sessions = await (await page.request.get('/api/sessions')).json();
    const session = sessions.find((s: any) => s.path.endsWith(name) && s.kernel);
    expect(session, `a session for ${name}`).toBeTruthy();
    id = session.kernel.id;
  }).toPass({ timeout: 30000 });
  return id;
}

function row(page: Page, kernelId: string) {
  return page.locator(`${PANEL} li.jp-GpuQuota-kernel[data-kernel-id="${kernelId}"]`);
}

const EMPTY_NOTEBOOK = JSON.stringify({
  cells: [{ cell_type: 'code', execution_count: null, metadata: {}, outputs: [], source: '' }],
  metadata: {
    kernelspec: { display_name: 'Python 3 (ipykernel)', language: 'python', name: 'python3' }
  },
  nbformat: 4,
  nbformat_minor: 5
});

/** A notebook `name` in the test's folder, opened: its kernel (python3) starts. Returns the kernel id. */
async function newNotebook(page: IJupyterLabPageFixture, tmpPath: string, name: string): Promise<string> {
  await page.contents.uploadContent(EMPTY_NOTEBOOK, 'text', `${tmpPath}/${name}`);
  // Opened by command: the file browser may be hidden behind the GPU quota tab.
  await page.evaluate(
    path => (window as any).jupyterapp.commands.execute('docmanager:open', { path }),
    `${tmpPath}/${name}`
  );
  await page.activity.activateTab(name);
  const id = await kernelOf(page, name);
  await expect(async () => {
    const kernel = await (await page.request.get(`/api/kernels/${id}`)).json();
    expect(kernel.execution_state).toBe('idle');
  }).toPass({ timeout: 30000 });
  return id;
}

async function runInNotebook(page: IJupyterLabPageFixture, name: string, code: string): Promise<string> {
  await page.activity.activateTab(name);
  await page.notebook.setCell(0, 'code', code);
  await page.notebook.runCell(0);
  return (await page.locator('.jp-Cell').first().locator('.jp-OutputArea-output').allInnerTexts()).join('\n');
}

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

  test('a server without a GPU: one line says why', async ({ page }) => {
    await page.route(/\/api\/gpu-quota\/status/, route =>
      route.fulfill({
        json: {
          gpu: false,
          message: 'no GPU: NVML library not found',
          user: 'test',
          devices: [],
          kernels: [],
          policy: {}
        }
      })
    );
    await page.goto();
    await openPanel(page);
    await expect(page.locator(`${PANEL} .jp-GpuQuota-message`)).toHaveText(
      'No GPU on this server: NVML library not found'
    );
  });
});

/**
 * The screenshots for the README. The CPU test machine has no monitor figures, so usage numbers are
 * added to the real server's answers here (said so in the README); everything else is real.
 */
function addSimulatedUsage(route: Route) {
  return route.fetch().then(async response => {
    const body = await response.json();
    const kernels = [...body.kernels].sort((x: any, y: any) => ((x.path || '') < (y.path || '') ? -1 : 1));
    const usedOf = [0.32, 0.93, 0.55];
    kernels.forEach((k: any, i: number) => {
      for (const d of k.devices) {
        d.used = Math.round(d.cap * usedOf[i % usedOf.length]);
        d.reserved = Math.round(d.used * 0.8);
        d.allocated = Math.round(d.used * 0.7);
        d.peak = d.reserved;
      }
      k.last_action =
        i === 1
          ? { time: Date.now() / 1000 - 42, action: 'warn', device: k.devices[0]?.index ?? 0, used: k.devices[0]?.used, cap: k.devices[0]?.cap }
          : null;
    });
    for (const d of body.devices) {
      d.used = body.kernels
        .flatMap((k: any) => k.devices)
        .filter((kd: any) => kd.index === d.index)
        .reduce((sum: number, kd: any) => sum + kd.used + 0.6 * GiB, 0);
    }
    await route.fulfill({ response, json: body });
  });
}

/** Wait until the panel's CSS transitions and animations have finished (what a screenshot must not catch midway). */
async function transitionsDone(page: any): Promise<void> {
  await page.locator(PANEL).evaluate((panel: Element) =>
    Promise.all(panel.getAnimations({ subtree: true }).map(animation => animation.finished))
  );
}

test('screenshots of the panel, light and dark', async ({ page, tmpPath }) => {
  await page.route(/\/api\/gpu-quota\/status/, addSimulatedUsage);
  await openPanel(page);
  await newNotebook(page, tmpPath, 'train.ipynb');
  await newNotebook(page, tmpPath, 'finetune.ipynb');
  await newNotebook(page, tmpPath, 'explore.ipynb');
  await runInNotebook(page, 'finetune.ipynb', '%gpucap 12GiB');
  await page.activity.activateTab('train.ipynb');
  await expect(page.locator(`${PANEL} li.jp-GpuQuota-kernel`)).toHaveCount(3);
  await expect(page.locator(STATUS)).toHaveText(/GPU \d/);
  await transitionsDone(page); // the bars' width transition
  await page.locator(PANEL).screenshot({ path: path.join(IMAGES, 'sidebar-light.png') });
  await page.screenshot({ path: path.join(IMAGES, 'lab-light.png') });
  await page.theme.setDarkTheme();
  await transitionsDone(page);
  await page.locator(PANEL).screenshot({ path: path.join(IMAGES, 'sidebar-dark.png') });
  // finetune.ipynb uses 93% of its cap: the status bar turns to the warning colour.
  await page.activity.activateTab('finetune.ipynb');
  await expect(page.locator(STATUS)).toHaveText('GPU 11.2 / 12 GiB');
  await expect(page.locator(STATUS)).toHaveClass(/jp-mod-warning/);
  await page.activity.activateTab('train.ipynb');
  await expect(page.locator(STATUS)).not.toHaveClass(/jp-mod-warning/);
});
