// Sortable tables (berth/table.html): each header of a table marked data-sortable becomes a button
// that sorts the rows by that column, again to reverse. A cell's data-sort (a raw number, a time)
// is its key where it has one, else its text; numbers sort as numbers, text naturally ("node-2"
// before "node-10"), and empty cells ("—") last either way. The choice survives htmx refreshes.
(() => {
  const chosen = new Map();  // table's place in the page → [column, direction]

  function place(table) {
    const holder = table.parentElement.closest("[id]") || document.body;
    return `${holder.id}:${[...holder.querySelectorAll("table[data-sortable]")].indexOf(table)}`;
  }

  function key(row, column) {
    const cell = row.cells[column];
    if (!cell || cell.classList.contains("absent")) return null;
    return cell.dataset.sort ?? cell.textContent.trim();
  }

  function compare(a, b) {
    if (a !== "" && b !== "" && Number.isFinite(Number(a)) && Number.isFinite(Number(b))) return Number(a) - Number(b);
    return a.localeCompare(b, undefined, {numeric: true, sensitivity: "base"});
  }

  function sort(table, column, direction) {
    const body = table.tBodies[0];
    const rows = [...body.rows].sort((r, s) => {
      const a = key(r, column), b = key(s, column);
      if (a === null || b === null) return (a === null) - (b === null);
      return direction * compare(a, b);
    });
    body.append(...rows);
    [...table.tHead.rows[0].cells].forEach((th, index) => {
      if (th.hasAttribute("aria-sort")) {
        th.setAttribute("aria-sort", index !== column ? "none" : direction > 0 ? "ascending" : "descending");
      }
    });
  }

  function enhance() {
    for (const table of document.querySelectorAll("table[data-sortable]")) {
      [...table.tHead.rows[0].cells].forEach((th, column) => {
        if (!th.hasAttribute("aria-sort") || th.querySelector("button.sort")) return;
        const button = document.createElement("button");
        button.type = "button";
        button.className = "sort";
        button.title = `Sort by ${th.textContent.trim()}`;
        button.append(...th.childNodes);
        th.append(button);
        button.addEventListener("click", () => {
          const [was, direction] = chosen.get(place(table)) || [];
          const now = was === column ? -direction : 1;
          chosen.set(place(table), [column, now]);
          sort(table, column, now);
        });
      });
      const kept = chosen.get(place(table));
      if (kept && table.tHead.rows[0].cells[kept[0]]?.getAttribute("aria-sort") === "none") sort(table, ...kept);
    }
  }

  document.addEventListener("DOMContentLoaded", enhance);
  document.addEventListener("htmx:afterSettle", enhance);
})();
