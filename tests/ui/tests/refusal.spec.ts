/**
 * What a JupyterLab user sees when a notebook's kernel cannot start because the GPUs are full (issue 19):
 * the quota's own words in JupyterLab's "Error Starting Kernel" dialog, from a 503 on POST /api/sessions,
 * not jupyter_server's 500 "HTTP 503: GPU budget full (...)".
 *
 * run.sh's server never refuses a start (no admission control). This file starts a server of its own for its
 * tests: run.sh's config (Galata's setup, the extension) with one 80 GiB GPU, caps of 0.6 of it, a budget of
 * the device (overcommit 1.0) and on_full "refuse": one kernel fills it. It is stopped after the tests.
 */
import { expect, test } from '@jupyterlab/galata';
import { ChildProcess, execFileSync, spawn } from 'child_process';
import * as fs from 'fs';
import * as os from 'os';
import * as path from 'path';

const PYTHON = process.env.PYTHON || 'python';
const PORT = Number(
  execFileSync(PYTHON, [
    '-c',
    'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
  ])
    .toString()
    .trim()
);
const URL = `http://127.0.0.1:${PORT}`;

let server: ChildProcess | null = null;
let log = '';

test.use({ baseURL: URL });

test.beforeAll(async () => {
  const root = fs.mkdtempSync(path.join(os.tmpdir(), 'gq-ui-refusal-'));
  server = spawn(
    PYTHON,
    [
      '-m',
      'jupyter',
      'lab',
      '--config',
      path.join(__dirname, '..', 'jupyter_server_test_config.py'),
      '--allow-root',
      '--no-browser',
      '--StaticInventory.devices=[{"name": "Full GPU", "total": "80GiB"}]',
      '--GpuQuota.default_cap=0.6',
      '--GpuQuota.max_cap=0.6',
      '--GpuQuota.overcommit=1.0',
      '--GpuQuota.on_full=refuse'
    ],
    {
      env: { ...process.env, GQ_UI_PORT: String(PORT), JUPYTERLAB_GALATA_ROOT_DIR: root },
      stdio: ['ignore', 'ignore', 'pipe']
    }
  );
  server.stderr!.on('data', chunk => (log += chunk.toString()));
  const deadline = Date.now() + 60000;
  for (;;) {
    try {
      const answer = await fetch(`${URL}/api/gpu-quota/status`);
      if (answer.ok) {
        break;
      }
    } catch {
      // not listening yet
    }
    if (server.exitCode !== null || Date.now() > deadline) {
      throw new Error(`the refusing server did not start:\n${log.slice(-3000)}`);
    }
    await new Promise(resolve => setTimeout(resolve, 250));
  }
});

test.afterAll(async () => {
  if (server && server.exitCode === null) {
    const exited = new Promise(resolve => server!.once('exit', resolve));
    server.kill('SIGTERM');
    await exited;
  }
});

test('a notebook opened when the GPUs are full says why its kernel did not start', async ({ page }) => {
  // The first kernel takes 0.6 of the GPU: no second one fits.
  const holder = await page.request.post('/api/kernels', { data: { name: 'python3' } });
  expect(holder.status()).toBe(201);

  // What JupyterLab sends when it opens a notebook: the server's answer itself, as the browser gets it.
  const answered = page.waitForResponse(
    response => response.url().includes('/api/sessions') && response.request().method() === 'POST'
  );
  // File>New>Notebook, then the kernel picker's accept (Python 3), as a user does it.
  await page.menu.clickMenuItem('File>New>Notebook');
  await page.locator('.jp-Dialog').waitFor();
  await page.click('.jp-Dialog .jp-mod-accept');
  const session = await answered;
  expect(session.status()).toBe(503);
  expect((await session.json()).reason).toBe('GPU budget full');

  const dialog = page.locator('.jp-Dialog').filter({ hasText: 'Error Starting Kernel' });
  await expect(dialog).toBeVisible({ timeout: 30000 });
  const text = (await dialog.locator('.jp-Dialog-body').innerText()).trim();
  expect(text).toContain('GPU quota: kernel not started: no GPU has 0.6 of budget left');
  expect(text).not.toContain('HTTP 503');
  expect(text).not.toContain('Unhandled error');
  await page.screenshot({ path: path.join(os.tmpdir(), 'gq-ui-refusal-dialog.png') });
  await dialog.getByRole('button', { name: 'Ok' }).click();
  await expect(dialog).toBeHidden();

  const kernels = await (await page.request.get('/api/kernels')).json();
  expect(kernels.map((kernel: { id: string }) => kernel.id)).toEqual([(await holder.json()).id]);
});
