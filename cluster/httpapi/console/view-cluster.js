// Cluster: every node's role, term, indexes, lag, reachability, readiness (what its /readyz
// says, the reason on hover), version (chronomq and Raft wire) and uptime; the leader; a
// timeline of leader changes. Polled twice a second, so a failover shows within a second.
import { api, fill, badge, card, fmtDuration, fmtInt, fmtTime, h, table } from "./app.js";

export function create(main) {
  const summary = h("section", { class: "cards", id: "cluster-summary" });
  const nodes = h("section", { id: "cluster-nodes" });
  const timeline = h("section", { id: "cluster-timeline" });
  const others = h("p", { class: "hint", id: "cluster-others" });
  main.append(h("h1", {}, "Cluster"), summary, h("h2", {}, "Nodes"), nodes, others,
    h("h2", {}, "Leader changes"), timeline);
  let known = [];
  return {
    title: "Cluster",
    every: 500,
    async refresh() {
      const view = await api("/v1/admin/cluster");
      known = view.nodes.map((n) => n.http_url).filter(Boolean);
      const leader = view.nodes.find((n) => n.id === view.leader);
      summary.replaceChildren(
        card("Leader", view.leader === null ? "none (election)" : `node ${view.leader}`, { id: "leader-id", "data-leader": view.leader ?? "" }),
        card("Leader URL", leader ? leader.http_url : "–", { id: "leader-url" }),
        card("Term", fmtInt(view.term), { id: "cluster-term" }),
        card("Reachable", `${view.nodes.filter((n) => n.reachable).length} of ${view.nodes.length}`),
      );
      nodes.replaceChildren(table(
        ["id", "role", "term", "commit index", "applied index", "lag", "reachable", "ready", "version", "uptime", "http URL"],
        view.nodes.map((n) => h("tr", { "data-node": n.id, class: n.reachable ? "" : "down" },
          h("td", {}, n.id),
          h("td", {}, badge(n.role, n.role === "leader" ? "good" : n.reachable ? "" : "bad")),
          h("td", { class: "num" }, fmtInt(n.term)),
          h("td", { class: "num" }, fmtInt(n.commit_index)),
          h("td", { class: "num" }, fmtInt(n.applied_index)),
          h("td", { class: "num" }, fmtInt(n.replication_lag)),
          h("td", {}, n.reachable ? badge("yes", "good") : badge("no", "bad")),
          h("td", { class: "ready", title: n.ready_reason || "" },
            n.ready === undefined ? "–" : n.ready ? badge("yes", "good") : badge("no", "bad")),
          h("td", { class: "version" }, n.version ? `${n.version} (wire ${n.wire_version ?? "?"})` : "–"),
          h("td", {}, fmtDuration(n.uptime_s)),
          h("td", {}, n.http_url ? h("a", { href: `${n.http_url}/console#cluster` }, n.http_url) : "–"),
        )),
        { id: "nodes-table" },
      ));
      const changes = (view.leader_changes || []).slice().reverse();
      timeline.replaceChildren(changes.length === 0 ? h("p", { class: "hint" }, "No leader change seen by this node yet.") :
        h("ol", { class: "timeline" }, changes.map((c) => h("li", {},
          h("time", {}, fmtTime(c.at_ms)), " ",
          c.from === null ? "leader elected: " : `node ${c.from} → `,
          h("strong", {}, `node ${c.to}`),
          c.term ? ` (term ${c.term})` : "",
          c.election_ms !== null && c.election_ms !== undefined ? `, after ${c.election_ms} ms without a leader` : "",
        ))));
      others.textContent = "";
    },
    failed() {
      fill(others, "This node does not answer. The console of another node: ",
        known.map((u) => h("a", { href: `${u}/console#cluster` }, u)).flatMap((a) => [a, " "]));
    },
  };
}
