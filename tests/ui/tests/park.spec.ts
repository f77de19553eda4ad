/**
 * Parking in the sidebar: each kernel's park state in words, and its Park / Resume buttons.
 *
 * The first group runs against any server of run.sh: the real server's status answer gets a "park"
 * object added in the browser (page.route, as the screenshots add usage figures), and the buttons'
 * POSTs are caught there too, so that what the sidebar sends (route, method, XSRF header) is checked
 * without a GPU or the server side of parking. The second group needs the server's park routes
 * (the server side of parking): it skips, saying so, where the server sends no park state.
 */
import { expect, test } from '@jupyterlab/galata';
import type { Request, Route } from '@playwright/test';

import { GiB, openPanel, row, startKernel } from './helpers';

// shared/contract.py: PARK_SUFFIX, RESUME_SUFFIX
const PARK_ROUTE = /\/api\/gpu-quota\/kernels\/[^/?]+\/(park|resume)(\?|$)/;

interface IPark {
  state: string;
  since: number | null;
  idle_seconds: number | null;
  host_bytes: number | null;
  parkable: boolean;
  reason: string | null;
  waited: number | null;
  wait_limit: number | null;
  told: boolean;
}

function park(state: string, extra: Partial<IPark> = {}): IPark {
  return {
    state,
    since: null,
    idle_seconds: null,
    host_bytes: null,
    parkable: true,
    reason: null,
    waited: null,
    wait_limit: 300,
    told: false,
    ...extra
  };
}

/** The real status answer, with `parks[kernel id]` as that kernel's park object. */
function withPark(parks: Record<string, IPark>) {
  return (route: Route) =>
    route.fetch().then(async response => {
      const body = await response.json();
      for (const kernel of body.kernels) {
        if (parks[kernel.id]) {
          kernel.park = parks[kernel.id];
        }
      }
      await route.fulfill({ response, json: body });
    });
}

test.describe('Park and Resume in the sidebar (park state added in the browser)', () => {
  test('the state in words, Park for a parkable kernel, and the POST it sends', async ({ page }) => {
    const kernelId = await startKernel(page);
    try {
      const parks: Record<string, IPark> = { [kernelId]: park('idle', { idle_seconds: 12 * 60 }) };
      await page.route(/\/api\/gpu-quota\/status/, withPark(parks));
      const sent: Request[] = [];
      await page.route(PARK_ROUTE, async route => {
        sent.push(route.request());
        parks[kernelId] = park('pending');
        await route.fulfill({ status: 202, json: { park: parks[kernelId] } });
      });
      await openPanel(page);
      const r = row(page, kernelId);
      await expect(r.locator('.jp-GpuQuota-line')).toHaveText('idle for 12 min');
      const parkButton = r.getByRole('button', { name: 'Park' });
      await expect(parkButton).toBeEnabled();
      await expect(r.getByRole('button', { name: 'Resume' })).toBeHidden();
      await parkButton.click();
      await expect(r.locator('.jp-GpuQuota-feedback')).toHaveText('Parks when its current cell ends');
      expect(sent).toHaveLength(1);
      expect(sent[0].method()).toBe('POST');
      expect(new URL(sent[0].url()).pathname).toBe(`/api/gpu-quota/kernels/${kernelId}/park`);
      // The server's XSRF protection: the sidebar sends the header from the cookie, like its cap requests.
      expect(sent[0].headers()['x-xsrftoken']).toBeTruthy();
      await expect(r.locator('.jp-GpuQuota-line')).toHaveText('parks when its current cell ends');
      await expect(parkButton).toBeDisabled();
    } finally {
      await page.request.delete(`/api/kernels/${kernelId}`);
    }
  });

  test('a parked kernel offers Resume; a waiting one says for how long and what for', async ({ page }) => {
    const kernelId = await startKernel(page);
    try {
      const since = Date.now() / 1000 - 600;
      const parks: Record<string, IPark> = {
        [kernelId]: park('parked', { since, host_bytes: Math.round(17.8 * GiB) })
      };
      await page.route(/\/api\/gpu-quota\/status/, withPark(parks));
      const sent: string[] = [];
      await page.route(PARK_ROUTE, async route => {
        sent.push(new URL(route.request().url()).pathname);
        parks[kernelId] = park('waiting', { reason: 'needs 17.8 GiB on GPU 0; making room', waited: 12 });
        await route.fulfill({ status: 202, json: { park: parks[kernelId] } });
      });
      await openPanel(page);
      const r = row(page, kernelId);
      await expect(r.locator('.jp-GpuQuota-line')).toHaveText(/^parked since \d\d:\d\d, 17\.8 GiB on host$/);
      await expect(r.getByRole('button', { name: 'Park' })).toBeHidden();
      await r.getByRole('button', { name: 'Resume' }).click();
      // The click returns before the request reaches the route: wait for it, never assume it.
      await expect.poll(() => sent).toEqual([`/api/gpu-quota/kernels/${kernelId}/resume`]);
      await expect(r.locator('.jp-GpuQuota-line')).toHaveText(
        'waiting for device memory for 12 s (limit 5 min): needs 17.8 GiB on GPU 0; making room'
      );
      // Asking again brings nothing sooner: the broker brings it back as soon as there is room.
      await expect(r.getByRole('button', { name: 'Resume' })).toBeDisabled();
    } finally {
      await page.request.delete(`/api/kernels/${kernelId}`);
    }
  });

  test('a kernel that cannot be parked: Park disabled, the reason its tooltip, said once', async ({ page }) => {
    const kernelId = await startKernel(page);
    try {
      const reason = 'not parkable: this kernel is an MPS client (the driver answers 801, not supported)';
      await page.route(/\/api\/gpu-quota\/status/, withPark({ [kernelId]: park('busy', { parkable: false, reason }) }));
      await openPanel(page);
      const r = row(page, kernelId);
      const parkButton = r.getByRole('button', { name: 'Park' });
      await expect(parkButton).toBeDisabled();
      await expect(parkButton).toHaveAttribute('title', reason);
      await expect(r.locator('.jp-GpuQuota-line')).toHaveText(
        'Not parkable: this kernel is an MPS client (the driver answers 801, not supported)'
      );
    } finally {
      await page.request.delete(`/api/kernels/${kernelId}`);
    }
  });

  test('a server without the park routes: one line, nothing else changes', async ({ page }) => {
    const kernelId = await startKernel(page);
    try {
      await page.route(/\/api\/gpu-quota\/status/, withPark({ [kernelId]: park('idle', { idle_seconds: 60 }) }));
      await page.route(PARK_ROUTE, route => route.fulfill({ status: 404, json: { message: 'Not Found' } }));
      await openPanel(page);
      const r = row(page, kernelId);
      await r.getByRole('button', { name: 'Park' }).click();
      await expect(r.locator('.jp-GpuQuota-feedback')).toHaveText(
        'Park failed: this server cannot park kernels: it has no park route (HTTP 404)'
      );
      await expect(r.locator('.jp-GpuQuota-line')).toHaveText('idle for 1 min');
    } finally {
      await page.request.delete(`/api/kernels/${kernelId}`);
    }
  });
});

test.describe('Park and Resume against the server side of parking', () => {
  test('the server\'s park state is shown and its buttons follow it', async ({ page }) => {
    const kernelId = await startKernel(page);
    try {
      const status = await (await page.request.get('/api/gpu-quota/status')).json();
      const kernel = status.kernels.find((k: any) => k.id === kernelId);
      test.skip(!kernel?.park, 'this server sends no park state (the server side of parking is not merged)');
      await openPanel(page);
      const r = row(page, kernelId);
      await expect(r.locator('.jp-GpuQuota-line')).toBeVisible();
      const parkButton = r.getByRole('button', { name: 'Park' });
      if (kernel.park.parkable === false) {
        // The kernel holds no GPU memory (the fake NVML sees none of it): the server says so, and the button why.
        await expect(parkButton).toBeDisabled();
        await expect(parkButton).toHaveAttribute('title', /\S/);
        const answer = await page.request.post(`/api/gpu-quota/kernels/${kernelId}/park`, {
          headers: { 'X-XSRFToken': (await page.context().cookies()).find(c => c.name === '_xsrf')?.value || '' }
        });
        expect([202, 409]).toContain(answer.status());
      } else {
        await expect(parkButton).toBeEnabled();
        const posted = page.waitForRequest(request => PARK_ROUTE.test(request.url()) && request.method() === 'POST');
        await parkButton.click();
        const response = await (await posted).response();
        expect(response?.status()).toBe(202);
        await expect(r.locator('.jp-GpuQuota-line')).toHaveText(/parks when its current cell ends|parking|parked since/);
      }
    } finally {
      await page.request.delete(`/api/kernels/${kernelId}`);
    }
  });
});
