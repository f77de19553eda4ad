/**
 * The usage chart of a kernel row as DOM: one SVG whose paths chart.ts computes, kept and updated in place
 * (an attribute is written only when it changed), and a "usage unknown" label over it when no usage figure
 * is known. Its tooltip and accessible name say in words what it shows (chart.ts: chartSummary).
 */

import { CHART_HEIGHT, CHART_WIDTH, chartSummary, IChart } from './chart';
import { setAttr } from './dom';

const SVG = 'http://www.w3.org/2000/svg';

function svg<K extends keyof SVGElementTagNameMap>(tag: K, className: string): SVGElementTagNameMap[K] {
  const node = document.createElementNS(SVG, tag);
  node.setAttribute('class', className);
  return node;
}

export class UsageChart {
  readonly node = document.createElement('div');

  constructor(unknownText: string) {
    this.node.className = 'jp-GpuQuota-chart';
    this.node.setAttribute('role', 'img');
    this._svg.setAttribute('viewBox', `0 0 ${CHART_WIDTH} ${CHART_HEIGHT}`);
    this._svg.setAttribute('preserveAspectRatio', 'none');
    this._svg.setAttribute('aria-hidden', 'true');
    this._svg.append(this._parks, this._reserved, this._allocated, this._cap, this._hardLimit, this._used);
    this._unknown.className = 'jp-GpuQuota-chartUnknown';
    this._unknown.textContent = unknownText;
    this.node.append(this._svg, this._unknown);
  }

  update(chart: IChart): void {
    setAttr(this._reserved, 'd', chart.reserved);
    setAttr(this._allocated, 'd', chart.allocated);
    setAttr(this._used, 'd', chart.used);
    setAttr(this._cap, 'd', chart.cap);
    setAttr(this._hardLimit, 'd', chart.hardLimit);
    const bands = this._parks.children;
    while (bands.length > chart.parks.length) {
      bands[bands.length - 1].remove();
    }
    while (bands.length < chart.parks.length) {
      this._parks.appendChild(svg('rect', 'jp-GpuQuota-chartPark'));
    }
    chart.parks.forEach((band, i) => {
      const rect = bands[i];
      setAttr(rect, 'x', String(band.x));
      setAttr(rect, 'y', '0');
      setAttr(rect, 'width', String(band.width));
      setAttr(rect, 'height', String(CHART_HEIGHT));
      setAttr(rect, 'data-state', band.state);
    });
    const unknown = !chart.known;
    if (this._unknown.hidden === unknown) {
      this._unknown.hidden = !unknown;
    }
    this.node.classList.toggle('jp-mod-unknown', unknown);
    const words = chartSummary(chart).join('\n');
    setAttr(this.node, 'title', words);
    setAttr(this.node, 'aria-label', words);
  }

  private _svg = svg('svg', 'jp-GpuQuota-chartSvg');
  private _parks = svg('g', 'jp-GpuQuota-chartParks');
  private _reserved = svg('path', 'jp-GpuQuota-chartReserved');
  private _allocated = svg('path', 'jp-GpuQuota-chartAllocated');
  private _cap = svg('path', 'jp-GpuQuota-chartCap');
  private _hardLimit = svg('path', 'jp-GpuQuota-chartHardLimit');
  private _used = svg('path', 'jp-GpuQuota-chartUsed');
  private _unknown = document.createElement('span');
}
