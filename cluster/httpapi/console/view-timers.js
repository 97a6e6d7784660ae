// Timers: backlog, read-behind, what falls due in the next hour (from the wheel), and cancel by
// msg_id with the node's exact answer.
import { api, card, confirmAction, errorText, fmtInt, fmtMs, h, svg } from "./app.js";

function histogram(hist) {
  const W = 720, H = 180, pad = 28;
  const n = hist.buckets.length;
  const max = Math.max(1, ...hist.buckets.map((b) => b.messages));
  const bw = (W - pad) / n;
  const bars = hist.buckets.map((b, i) => {
    const bh = ((H - pad) * b.messages) / max;
    const minute = Math.round((b.start_ms - hist.from_ms) / 60000);
    return svg("rect", { x: pad + i * bw + 1, y: H - pad - bh, width: Math.max(1, bw - 2), height: bh, class: "bar", "data-messages": b.messages },
      svg("title", {}, `+${minute} min: ${b.messages} messages, ${b.cancels} cancels`));
  });
  const labels = [0, 15, 30, 45, 60].map((m) => svg("text", { x: pad + ((W - pad) * m) / 60, y: H - 8, class: "axis" }, `+${m}m`));
  return svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "histogram", role: "img", "aria-label": "messages due per minute" },
    svg("text", { x: 0, y: 12, class: "axis" }, fmtInt(max)),
    svg("line", { x1: pad, y1: H - pad, x2: W, y2: H - pad, class: "axis-line" }),
    ...bars, ...labels);
}

export function create(main) {
  const cards = h("section", { class: "cards", id: "timer-cards" });
  const chart = h("section", { id: "timer-histogram" });
  const input = h("input", { id: "cancel-id", placeholder: "msg_id (32 hex characters)", size: 36, spellcheck: "false" });
  const answer = h("pre", { id: "cancel-answer", class: "answer" });
  const button = h("button", { id: "cancel-button", onclick: cancel }, "Cancel timer");
  main.append(h("h1", {}, "Timers"), cards,
    h("h2", {}, "Due in the next hour"), chart,
    h("h2", {}, "Cancel a timer message"),
    h("p", { class: "form" }, input, " ", button), answer);

  async function cancel() {
    const id = input.value.trim();
    if (!id) return;
    if (!(await confirmAction(`Cancel timer message ${id}? It will not be delivered.`))) return;
    try {
      const r = await api(`/v1/timers/${encodeURIComponent(id)}`, { method: "DELETE" });
      answer.textContent = JSON.stringify(r, null, 2);
      answer.className = `answer ${r.status}`;
    } catch (e) {
      answer.textContent = e.body ? JSON.stringify(e.body, null, 2) : errorText(e);
      answer.className = "answer error";
    }
  }

  return {
    title: "Timers",
    every: 2000,
    async refresh() {
      const [st, hist] = await Promise.all([api("/v1/admin/timer"), api("/v1/admin/timer/histogram")]);
      cards.replaceChildren(
        card("Backlog", fmtInt(st.backlog.total), { id: "timer-backlog", "data-value": st.backlog.total }),
        card("Read-behind", fmtMs(st.read_behind_ms), { id: "timer-read-behind", "data-value": st.read_behind_ms }),
        card("Not yet in the wheel", fmtInt(st.offset_behind)),
        card("Enqueue / dequeue per s", `${st.rates.enqueue_per_s} / ${st.rates.dequeue_per_s}`),
        card("Due in the next hour", fmtInt(hist.total), { id: "timer-due-hour", "data-value": hist.total }),
        card("Overdue", fmtInt(hist.overdue.messages)),
        card("Switches", `${st.switches.stop_enqueue ? "enqueue stopped" : "enqueue on"}, ${st.switches.stop_dequeue ? "delivery stopped" : "delivery on"}`),
      );
      chart.replaceChildren(histogram(hist));
    },
  };
}
