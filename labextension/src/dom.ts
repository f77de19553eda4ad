/**
 * The sidebar's few DOM helpers. Its rows are kept across polls and updated in place, so every setter
 * writes only when the value differs: a poll with 200 kernels touches only the figures that changed, and
 * the browser relays out nothing for the rest.
 */

/** A new element with its class (and its text, when given). */
export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

export function setText(node: HTMLElement, text: string): void {
  if (node.textContent !== text) {
    node.textContent = text;
  }
}

export function setAttr(node: Element, name: string, value: string): void {
  if (node.getAttribute(name) !== value) {
    node.setAttribute(name, value);
  }
}

export function setHidden(node: HTMLElement, hidden: boolean): void {
  if (node.hidden !== hidden) {
    node.hidden = hidden;
  }
}

// The colour classes of a level (derive.ts: usageLevel; the feedback's outcome): one at a time.
const LEVEL_CLASSES = ['jp-mod-ok', 'jp-mod-warning', 'jp-mod-over'];

/** The node's colour: `jp-mod-<level>` in place of the other level classes. */
export function setLevel(node: HTMLElement, level: string): void {
  const wanted = `jp-mod-${level}`;
  if (!node.classList.contains(wanted)) {
    node.classList.remove(...LEVEL_CLASSES);
    node.classList.add(wanted);
  }
}
