/**
 * What the Galata specs share: the panel's selectors, notebooks and kernels as a user starts them, the
 * scenario file that sets what the fake NVML sees (../ui_scenario.py), the sidebar's width as a user drags
 * it, and where screenshots go (a build folder, never the docs: those are `./run pictures`).
 */
import { expect, IJupyterLabPageFixture } from '@jupyterlab/galata';
import type { Page } from '@playwright/test';
import * as path from 'path';

export const PANEL_ID = 'gpu-quota-ext-panel';
export const PANEL = `#${PANEL_ID}`;
export const STATUS = '.jp-GpuQuota-status';
export const GiB = 1024 ** 3;
export const POLL_MS = 2000; // the schema's default refreshInterval

/** Where this run's screenshots go: build/ui (run.sh), or build/ui-pictures for `./run pictures`. */
export const OUT = process.env.GQ_UI_OUT || path.resolve(__dirname, '..', '..', '..', 'build', 'ui');

/** The scenario file under the server's root (run.sh: GQ_UI_SCENARIO). */
const SCENARIO = 'gpu-scenario.json';

export async function openPanel(page: IJupyterLabPageFixture): Promise<void> {
  await page.sidebar.openTab(PANEL_ID);
  await expect(page.locator(PANEL)).toBeVisible();
}

export function row(page: Page, kernelId: string) {
  return page.locator(`${PANEL} li.jp-GpuQuota-kernel[data-kernel-id="${kernelId}"]`);
}

/** The kernel of the notebook whose path ends with `name`, from the sessions API. */
export async function kernelOf(page: Page, name: string): Promise<string> {
  let id = '';
  await expect(async () => {
    const sessions = await (await page.request.get('/api/sessions')).json();
    const session = sessions.find((s: any) => s.path.endsWith(name) && s.kernel);
    expect(session, `a session for ${name}`).toBeTruthy();
    id = session.kernel.id;
  }).toPass({ timeout: 30000 });
  return id;
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
export async function newNotebook(page: IJupyterLabPageFixture, tmpPath: string, name: string): Promise<string> {
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

export async function runInNotebook(page: IJupyterLabPageFixture, name: string, code: string): Promise<string> {
  await page.activity.activateTab(name);
  await page.notebook.setCell(0, 'code', code);
  await page.notebook.runCell(0);
  // The active notebook's cell: the other open notebooks' cells are in the page too.
  return ((await page.notebook.getCellTextOutput(0)) || []).join('\n');
}

/** The PID of the notebook's kernel, as the kernel itself says (what NVML would list for it). */
export async function kernelPid(page: IJupyterLabPageFixture, name: string): Promise<number> {
  const printed = await runInNotebook(page, name, 'import os; print(os.getpid())');
  const pid = Number(printed.trim().split('\n').pop());
  expect(pid, `a PID printed by ${name}`).toBeGreaterThan(1);
  return pid;
}

/** A kernel started through the REST API, as a notebook would; its id. */
export async function startKernel(page: Page): Promise<string> {
  const response = await page.request.post('/api/kernels', { data: { name: 'python3' } });
  expect(response.ok()).toBe(true);
  return (await response.json()).id;
}

/** The kernel's grant as the status API says it: its device and its cap there. */
export async function grantOf(page: Page, kernelId: string): Promise<{ index: number; uuid: string; cap: number }> {
  const status = await (await page.request.get('/api/gpu-quota/status')).json();
  const kernel = status.kernels.find((k: any) => k.id === kernelId);
  expect(kernel, `kernel ${kernelId} in the status`).toBeTruthy();
  const device = kernel.devices[0];
  const uuid = status.devices.find((d: any) => d.index === device.index).uuid;
  return { index: device.index, uuid, cap: device.cap };
}

/** A notebook's kernel as the tests need it: its id and PID, and its grant's device. */
export interface IKernel {
  name: string;
  id: string;
  pid: number;
  index: number;
  uuid: string;
}

/** A new notebook (and its kernel) named `name`, with what the scenario and the checks address it by. */
export async function newNotebookKernel(
  page: IJupyterLabPageFixture,
  tmpPath: string,
  name: string
): Promise<IKernel> {
  const id = await newNotebook(page, tmpPath, name);
  const pid = await kernelPid(page, name);
  const grant = await grantOf(page, id);
  return { name, id, pid, index: grant.index, uuid: grant.uuid };
}

export interface IScenario {
  /** pid -> device uuid -> bytes NVML sees it hold. */
  usage?: Record<string, Record<string, number>>;
  other_used?: Record<string, number>;
  /** Devices NVML cannot read. */
  lost?: string[];
  /** The next n restores fail, as one into a full device does: the kernel is lost (its GPU state gone). */
  fail_restores?: number;
}

/** What the fake NVML sees from now on (its next sample reads the file). */
export async function setScenario(page: IJupyterLabPageFixture, scenario: IScenario): Promise<void> {
  // Whole bytes, as NVML reports them.
  const text = JSON.stringify(scenario, (_, value) => (typeof value === 'number' ? Math.round(value) : value));
  await page.contents.uploadContent(text, 'text', SCENARIO);
}

/** The allocator figures a kernel reports after a cell (POST kernels/<id>/usage, as the server's user). */
export async function reportAllocator(
  page: Page,
  kernelId: string,
  device: number,
  allocated: number,
  reserved: number
): Promise<void> {
  const response = await page.request.post(`/api/gpu-quota/kernels/${kernelId}/usage`, {
    data: {
      devices: [
        { index: device, allocated: Math.round(allocated), reserved: Math.round(reserved), peak: Math.round(reserved) }
      ]
    }
  });
  expect(response.ok(), await response.text()).toBe(true);
}

/** The sidebar widths the specs and the pictures look at: JupyterLab's default (also the narrowest it allows), wider. */
export const SIDEBAR_WIDTHS = { default: 250, medium: 330, wide: 450 };

/** Drag the handle between the left sidebar and the main area, as a user does, until the panel is `width` px. */
export async function setSidebarWidth(page: Page, width: number): Promise<number> {
  const panel = page.locator(PANEL);
  const handle = page.locator('#jp-main-split-panel > .lm-SplitPanel-handle').first();
  for (let attempt = 0; attempt < 3; attempt++) {
    const now = (await panel.boundingBox())!;
    const box = (await handle.boundingBox())!;
    const x = box.x + box.width / 2;
    const y = box.y + box.height / 2;
    await page.mouse.move(x, y);
    await page.mouse.down();
    await page.mouse.move(x + (width - now.width), y, { steps: 5 });
    await page.mouse.up();
    if (Math.abs((await panel.boundingBox())!.width - width) <= 2) {
      break;
    }
  }
  return Math.round((await panel.boundingBox())!.width);
}

/** Wait until the panel's CSS transitions and animations have finished (what a screenshot must not catch midway). */
export async function transitionsDone(page: Page): Promise<void> {
  await page.locator(PANEL).evaluate((panel: Element) =>
    Promise.all(panel.getAnimations({ subtree: true }).map(animation => animation.finished))
  );
}

export function shot(name: string): string {
  return path.join(OUT, name);
}
