// Topics: every topic with its queues, messages and rate; the queues of the selected topic with
// their min and max offsets. Rates come from two reads of the max offsets.
import { api, badge, fmtInt, h, table } from "./app.js";

const SYSTEM = [/^SCHEDULE_TOPIC_XXXX$/, /^rmq_sys_/, /^%RETRY%/, /^%DLQ%/];

function rate(prev, now, dtMs) {
  if (prev === undefined || dtMs <= 0) return null;
  return Math.max(0, ((now - prev) * 1000) / dtMs);
}

function fmtRate(r) {
  return r === null ? "–" : r.toFixed(1);
}

export function create(main) {
  const list = h("section", { id: "topics-list" });
  const detail = h("section", { id: "topic-detail" });
  main.append(h("h1", {}, "Topics"), list, detail);
  let selected = (location.hash.split("?topic=")[1] || "") && decodeURIComponent(location.hash.split("?topic=")[1]);
  let last = { at: 0, topics: {}, queues: {} };
  return {
    title: "Topics",
    every: 2000,
    async refresh() {
      const topics = [];
      let after = "";
      for (let page = 0; page < 20; page++) {
        const r = await api(`/v1/topics?after=${encodeURIComponent(after)}`);
        topics.push(...r.topics);
        if (!r.truncated) break;
        after = r.next_after;
      }
      const now = performance.now();
      const dt = last.at ? now - last.at : 0;
      if (!selected || !topics.some((t) => t.topic === selected)) {
        const user = topics.find((t) => !SYSTEM.some((re) => re.test(t.topic)));
        selected = user ? user.topic : topics.length ? topics[0].topic : "";
      }
      const counts = {};
      list.replaceChildren(topics.length === 0 ? h("p", { class: "hint" }, "No topic yet.") : table(
        ["topic", "queues", "messages", "messages/s"],
        topics.map((t) => {
          counts[t.topic] = t.messages;
          return h("tr", { "data-topic": t.topic, class: t.topic === selected ? "selected" : "" },
            h("td", {}, h("a", { href: "#topics", onclick: (e) => { e.preventDefault(); selected = t.topic; this.refresh(); } }, t.topic),
              SYSTEM.some((re) => re.test(t.topic)) ? [" ", badge("system", "muted")] : ""),
            h("td", { class: "num" }, fmtInt(t.queues)),
            h("td", { class: "num" }, fmtInt(t.messages)),
            h("td", { class: "num rate" }, fmtRate(rate(last.topics[t.topic], t.messages, dt))));
        }),
        { id: "topics-table" },
      ));
      const queues = {};
      if (selected) {
        const d = await api(`/v1/topics/${encodeURIComponent(selected)}`);
        detail.replaceChildren(h("h2", {}, `Queues of ${d.topic}`), table(
          ["queue", "min offset", "max offset", "messages/s"],
          d.queues.map((q) => {
            const key = `${d.topic}/${q.queue}`;
            queues[key] = q.max_offset;
            return h("tr", { "data-queue": q.queue },
              h("td", {}, q.queue),
              h("td", { class: "num min" }, fmtInt(q.min_offset)),
              h("td", { class: "num max" }, fmtInt(q.max_offset)),
              h("td", { class: "num rate" }, fmtRate(rate(last.queues[key], q.max_offset, dt))));
          }),
          { id: "queues-table", "data-topic": d.topic },
        ));
      } else {
        detail.replaceChildren();
      }
      last = { at: now, topics: counts, queues };
    },
  };
}
