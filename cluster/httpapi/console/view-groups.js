// Consumer groups: committed offsets and lag per queue; the group's retry and DLQ topics.
import { api, fill, badge, fmtInt, h, table } from "./app.js";

function side(label, t) {
  return h("span", { class: "side" }, `${label}: `, h("code", {}, t.topic), " ",
    t.exists ? `${fmtInt(t.messages)} messages` : badge("not created", "muted"));
}

export function create(main) {
  const list = h("section", { id: "groups-list" });
  main.append(h("h1", {}, "Consumer groups"), list);
  return {
    title: "Consumer groups",
    every: 2000,
    async refresh() {
      const r = await api("/v1/groups");
      fill(list, r.groups.length === 0 ? h("p", { class: "hint" }, "No consumer group has committed an offset yet.") :
        r.groups.map((g) => h("article", { class: "group", "data-group": g.group },
          h("h2", {}, g.group, " ", badge(`lag ${fmtInt(g.lag)}`, g.lag ? "warn" : "good")),
          h("p", {}, side("retry", g.retry), " · ", side("DLQ", g.dlq)),
          g.queues.length === 0 ? h("p", { class: "hint" }, "No committed offset.") : table(
            ["topic", "queue", "committed offset", "max offset", "lag"],
            g.queues.map((q) => h("tr", { "data-topic": q.topic, "data-queue": q.queue },
              h("td", {}, q.topic),
              h("td", {}, q.queue),
              h("td", { class: "num offset" }, fmtInt(q.offset)),
              h("td", { class: "num" }, fmtInt(q.max_offset)),
              h("td", { class: "num lag" }, fmtInt(q.lag)))),
          ))),
        r.truncated ? h("p", { class: "hint" }, "More groups follow (the list is cut at max_topics_listed).") : "");
    },
  };
}
