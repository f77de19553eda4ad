/**
 * The documentation site reads well at every width, in a real Chromium: the docs (docs/, Sphinx +
 * pydata-sphinx-theme) are built once into a temporary folder and their pages loaded from it at desktop widths
 * (1280 to 1920 px) and at a phone's (390 px).
 *
 * - The left navigation is never an empty column: on every top-level page where the theme shows it, it has
 *   links (the theme's default sidebar starts one level down, so Getting started had a "Section Navigation"
 *   heading over nothing); on Getting started it shows at every desktop width.
 * - No code block hides part of a line: each `pre` is no wider inside than its box (the docs' CSS wraps long
 *   lines; a horizontal scrollbar that most browsers draw only while scrolling looked like a cut line), and no
 *   ancestor that clips its overflow cuts it off.
 * - On a phone no page scrolls sideways.
 *
 * Each width's Getting started page is saved as a screenshot (build/ui/docs-getting-started-WIDTH.png).
 *
 * Needs no Jupyter server: the pages are files. The build uses the Python that run.sh's venv puts first on
 * PATH (GQ_DOCS_PYTHON overrides it), with warnings as errors as tests/docs/test_docs_build.py builds it.
 */
import { expect, Page, test } from '@playwright/test';
import { execFileSync } from 'child_process';
import * as fs from 'fs';
import * as os from 'os';
import * as path from 'path';

import { shot } from './helpers';

const ROOT = path.resolve(__dirname, '..', '..', '..');
const DESKTOP_WIDTHS = [1280, 1400, 1600, 1920];
const PHONE_WIDTH = 390;
const ALL_WIDTHS = [...DESKTOP_WIDTHS, PHONE_WIDTH];

let site = '';
let pages: string[] = []; // every page of the site, relative to it ("user-guide/sidebar.html")

test.beforeAll(() => {
  site = fs.mkdtempSync(path.join(os.tmpdir(), 'gq-docs-'));
  execFileSync(
    process.env.GQ_DOCS_PYTHON || 'python',
    ['-m', 'sphinx', '-W', '--keep-going', '-q', '-b', 'html', path.join(ROOT, 'docs'), site],
    { stdio: 'inherit', timeout: 280000, env: { ...process.env, PYTHONDONTWRITEBYTECODE: '1' } }
  );
  const walk = (dir: string): string[] =>
    fs.readdirSync(dir, { withFileTypes: true }).flatMap(entry => {
      const full = path.join(dir, entry.name);
      if (entry.isDirectory()) {
        return entry.name.startsWith('_') ? [] : walk(full);
      }
      return entry.name.endsWith('.html') ? [path.relative(site, full)] : [];
    });
  // The generated index and the search page have no content of their own to lay out.
  pages = walk(site).filter(p => !['genindex.html', 'search.html'].includes(p));
  expect(pages).toContain('getting-started.html');
});

test.afterAll(() => {
  if (site) {
    fs.rmSync(site, { recursive: true, force: true });
  }
});

function url(page: string): string {
  return `file://${path.join(site, page)}`;
}

/** The site's top-level pages: those the header links to (its "More" menu included), as the home page lists them. */
async function topLevelPages(page: Page): Promise<string[]> {
  await page.goto(url('index.html'));
  const header = '.bd-header .navbar-header-items__center';
  const hrefs = await page
    .locator(`${header} a.nav-link, ${header} a.dropdown-item`)
    .evaluateAll(links => links.map(link => (link as HTMLAnchorElement).href));
  const found = [...new Set(hrefs.map(href => path.relative(site, decodeURI(new URL(href).pathname))))];
  expect(found).toContain('getting-started.html');
  return found;
}

/** The left navigation's links a reader can see now (a closed section's pages are not among them). */
function leftNavigationLinks(page: Page) {
  return page.locator('.bd-sidebar-primary nav.bd-docs-nav a:visible');
}

/** Each code block whose lines do not all show: wider inside than its box, or cut off by a clipping ancestor. */
async function hiddenCode(page: Page): Promise<string[]> {
  return page.locator('pre').evaluateAll(blocks =>
    blocks.flatMap(block => {
      const problems: string[] = [];
      const text = (block.textContent || '').trim().split('\n')[0].slice(0, 60);
      if (block.scrollWidth > block.clientWidth + 1) {
        problems.push(`"${text}": ${block.scrollWidth} px of code in ${block.clientWidth} px`);
      }
      const box = block.getBoundingClientRect();
      for (let node = block.parentElement; node; node = node.parentElement) {
        const overflow = getComputedStyle(node).overflowX;
        if (overflow === 'hidden' || overflow === 'clip') {
          const outer = node.getBoundingClientRect();
          if (box.right > outer.right + 1 || box.left < outer.left - 1) {
            problems.push(`"${text}": cut off by <${node.tagName.toLowerCase()} class="${node.className}">`);
          }
        }
      }
      return problems;
    })
  );
}

for (const width of ALL_WIDTHS) {
  test(`docs at ${width} px: no code block hides part of a line${
    width === PHONE_WIDTH ? ', no page scrolls sideways' : ''
  }`, async ({ page }) => {
    await page.setViewportSize({ width, height: 900 });
    const problems: string[] = [];
    for (const name of pages) {
      await page.goto(url(name));
      for (const problem of await hiddenCode(page)) {
        problems.push(`${name}: ${problem}`);
      }
      if (width === PHONE_WIDTH) {
        const scrollWidth = await page.evaluate(() => document.documentElement.scrollWidth);
        if (scrollWidth > width) {
          problems.push(`${name}: the page is ${scrollWidth} px wide`);
        }
      }
    }
    // What a reader sees at this width, kept with the run's other screenshots (build/ui, ignored by git).
    await page.goto(url('getting-started.html'));
    await page.screenshot({ path: shot(`docs-getting-started-${width}.png`) });
    expect(problems).toEqual([]);
  });
}

for (const width of DESKTOP_WIDTHS) {
  test(`docs at ${width} px: the left navigation is never an empty column`, async ({ page }) => {
    await page.setViewportSize({ width, height: 900 });
    const empty: string[] = [];
    for (const name of await topLevelPages(page)) {
      await page.goto(url(name));
      if ((await page.locator('.bd-sidebar-primary').isVisible()) && (await leftNavigationLinks(page).count()) === 0) {
        empty.push(name);
      }
    }
    expect(empty).toEqual([]);
    await page.goto(url('getting-started.html'));
    await expect(page.locator('.bd-sidebar-primary')).toBeVisible();
    await expect(leftNavigationLinks(page).first()).toBeVisible();
    await expect(leftNavigationLinks(page).filter({ hasText: /^User.s guide$/ })).toHaveCount(1);
  });
}
