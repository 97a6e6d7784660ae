// Delay levels: per level delay, backlog, oldest-due lag, pending, blocked; switch the delivery
// mode (sync/async) and pause/resume, cluster-wide, after a confirmation.
import { api, badge, confirmAction, errorText, fmtInt, fmtMs, h, table } from "./app.js";

export function create(main) {
  const controls = h("section", { class: "cards", id: "levels-controls" });
  const result = h("p", { id: "levels-result", class: "hint" });
  const levels = h("section", { id: "levels-table-wrap" });
  main.append(h("h1", {}, "Delay levels"), controls, result, levels);
  let state = null;

  async function change(body, text) {
    if (!(await confirmAction(text))) {
      result.textContent = "Nothing changed.";
      return;
    }
    try {
      const r = await api("/v1/admin/schedule", { method: "PATCH", body });
      result.textContent = `Done: mode ${r.mode}, ${r.paused ? "paused" : "delivering"}.`;
      result.className = "ok";
      await view.refresh();
    } catch (e) {
      result.textContent = errorText(e);
      result.className = "error";
    }
  }

  const view = {
    title: "Delay levels",
    every: 1000,
    async refresh() {
      state = await api("/v1/admin/schedule");
      const other = state.mode === "sync" ? "async" : "sync";
      controls.replaceChildren(
        h("div", { class: "card" }, h("div", { class: "label" }, "Delivery mode"),
          h("div", { class: "value", id: "schedule-mode" }, state.mode),
          h("button", { id: "switch-mode", onclick: () => change({ mode: other },
            `Switch every delay level of the cluster to ${other} delivery?`) }, `Switch to ${other}`)),
        h("div", { class: "card" }, h("div", { class: "label" }, "Delivery"),
          h("div", { class: "value", id: "schedule-paused" }, state.paused ? "paused" : "running"),
          h("button", { id: "toggle-pause", onclick: () => change({ paused: !state.paused },
            state.paused ? "Resume delivery of every delay level?" : "Pause delivery of every delay level? Due messages will wait.") },
          state.paused ? "Resume" : "Pause")),
        h("div", { class: "card" }, h("div", { class: "label" }, "This node delivers"),
          h("div", { class: "value" }, state.running ? `yes (term ${state.term})` : "no (follower)")),
      );
      levels.replaceChildren(table(
        ["level", "delay", "offset", "max offset", "backlog", "oldest-due lag", "pending", "blocked"],
        state.levels.map((l) => h("tr", { "data-level": l.level },
          h("td", {}, l.level),
          h("td", {}, l.delay),
          h("td", { class: "num" }, fmtInt(l.offset)),
          h("td", { class: "num" }, fmtInt(l.max_offset)),
          h("td", { class: "num backlog" }, fmtInt(l.backlog)),
          h("td", { class: "num lag" }, fmtMs(l.oldest_due_lag_ms)),
          h("td", { class: "num pending" }, fmtInt(l.pending)),
          h("td", {}, l.blocked ? badge("blocked", "bad") : badge("no", "good")))),
        { id: "levels-table" },
      ));
    },
  };
  return view;
}
