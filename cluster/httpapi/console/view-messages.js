// Messages: look one up by msg_id, or by key in a topic; where it waits and when it is due, or
// when and where it was delivered.
import { api, fill, badge, errorText, fmtTime, fmtWhen, h } from "./app.js";

function place(p) {
  return p ? `${p.topic} queue ${p.queue} offset ${p.offset}` : "–";
}

function waits(m) {
  if (m.status !== "waiting") return null;
  if (m.kind === "level") return `delay level ${m.delay_level}: ${place(m.stored)}`;
  if (m.kind === "timer") return `timer wheel slot ${fmtTime(m.wheel_slot_ms)} (stored at ${place(m.stored)})`;
  return place(m.stored);
}

function describe(m) {
  const rows = [
    ["msg_id", h("code", {}, m.msg_id)],
    ["kind", m.kind],
    ["status", badge(m.status, { delivered: "good", waiting: "warn", cancelled: "bad", stored: "good" }[m.status] || "")],
    ["topic", m.queue === null ? m.topic : `${m.topic} (queue ${m.queue})`],
    ["keys", m.keys.join(" ") || "–"],
    ["tags", m.tags || "–"],
    ["stored", m.stored ? `${place(m.stored)} at ${fmtTime(m.stored.store_ms)}` : "–"],
  ];
  const w = waits(m);
  if (w) rows.push(["waits in", w]);
  if (m.due_ms !== null) rows.push(["due", fmtWhen(m.due_ms)]);
  if (m.delivered) rows.push(["delivered", `${fmtWhen(m.delivered_ms)} to ${place(m.delivered)}`]);
  else if (m.status === "delivered") rows.push(["delivered", "yes (its copy was not found within the search bound)"]);
  return h("article", { class: "message", "data-msg-id": m.msg_id, "data-status": m.status },
    h("dl", {}, rows.map(([k, v]) => [h("dt", {}, k), h("dd", { "data-field": k }, v)])));
}

export function create(main) {
  const idInput = h("input", { id: "lookup-id", placeholder: "msg_id", size: 36, spellcheck: "false" });
  const idTopic = h("input", { id: "lookup-id-topic", placeholder: "topic (optional)", size: 16 });
  const keyTopic = h("input", { id: "lookup-topic", placeholder: "topic", size: 16 });
  const keyInput = h("input", { id: "lookup-key", placeholder: "key", size: 20 });
  const out = h("section", { id: "lookup-result" });
  const byId = async () => {
    const id = idInput.value.trim();
    if (!id) return;
    out.replaceChildren(h("p", { class: "hint" }, "Searching…"));
    const topic = idTopic.value.trim();
    try {
      const m = await api(`/v1/messages/${encodeURIComponent(id)}${topic ? `?topic=${encodeURIComponent(topic)}` : ""}`);
      out.replaceChildren(describe(m));
    } catch (e) {
      out.replaceChildren(h("p", { class: "error" }, errorText(e)));
    }
  };
  const byKey = async () => {
    const topic = keyTopic.value.trim();
    const key = keyInput.value.trim();
    if (!topic || !key) return;
    out.replaceChildren(h("p", { class: "hint" }, "Searching…"));
    try {
      const r = await api(`/v1/topics/${encodeURIComponent(topic)}/messages?key=${encodeURIComponent(key)}`);
      fill(out,
        h("p", { class: "hint" }, `${r.messages.length} message(s) with key ${r.key} in ${r.topic}` +
          `${r.complete ? "" : " (the scan stopped at its bound: older ones may exist)"}${r.truncated ? ", more not shown" : ""}.`),
        r.messages.map(describe));
    } catch (e) {
      out.replaceChildren(h("p", { class: "error" }, errorText(e)));
    }
  };
  const enter = (fn) => (e) => { if (e.key === "Enter") fn(); };
  idInput.addEventListener("keydown", enter(byId));
  keyInput.addEventListener("keydown", enter(byKey));
  main.append(h("h1", {}, "Messages"),
    h("p", { class: "form" }, h("label", {}, "By id ", idInput), " ", idTopic, " ", h("button", { id: "lookup-id-button", onclick: byId }, "Find")),
    h("p", { class: "form" }, h("label", {}, "By key ", keyTopic), " ", keyInput, " ", h("button", { id: "lookup-key-button", onclick: byKey }, "Find")),
    out);
  return { title: "Messages", every: 0, async refresh() {} };
}
