"""The web console in a real browser (Debian's chromium driven by Playwright) against 3 real node
processes: every view loads without console errors and shows what the API says; switching the
delay levels to async and cancelling a timer from the page take effect in the cluster; after the
leader is SIGKILLed the cluster view names the new one within 2 s; with auth_token set the page
asks for the token and keeps it for the tab. Each view's screenshot goes to docs/console/."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.test_console_api import call, produce, until

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS = Path(__file__).resolve().parents[2] / "docs" / "console"
TOKEN = "console-browser-token-0123"
# Fast elections, as DESIGN.md measured them (0.3-0.6 s): the 2 s bound is the console's.
FAST_ELECTIONS = {"raft_min_timeout_ms": 300, "raft_max_timeout_ms": 600}


@pytest.fixture
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is missing: pip install -e '.[test]'")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


class Page:
    """A tab that records console errors and uncaught exceptions."""

    def __init__(self, browser: Any, base: str) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 860})
        self.page = self.context.new_page()
        self.base = base
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def view(self, name: str) -> Any:
        self.page.goto(f"{self.base}/console#{name}")
        self.page.wait_for_selector(f'main[data-loaded="{name}"]', timeout=10_000)
        return self.page

    def shot(self, name: str) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)

    def text(self, selector: str) -> str:
        return str(self.page.locator(selector).first.inner_text()).strip()


def num(text: str) -> int:
    return int(text.replace(",", ""))


def seed(url: str) -> dict[str, str]:
    """A topic with plain and delayed messages, a consumer group, timers due within the hour."""
    assert call(f"{url}/v1/topics/orders", "PUT", {"queues": 4})[0] == 201
    now = int(time.time() * 1000)
    plain = produce(url, "orders", [{"body": f"m{i}", "keys": [f"order-{i}"]} for i in range(40)])
    delayed = produce(
        url,
        "orders",
        [{"body": "in two hours", "keys": ["order-7"], "delay_level": 18}]
        + [{"body": "in an hour", "keys": ["order-9"], "delay_level": 17}],
    )
    timers = produce(
        url,
        "orders",
        [
            {"body": f"t{i}", "keys": ["invoice"], "deliver_at_ms": now + (3 + i * 7) * 60_000}
            for i in range(8)
        ],
    )
    for q in range(4):
        assert (
            call(
                f"{url}/v1/groups/billing/offsets",
                "PUT",
                {"topic": "orders", "queue": q, "offset": 3},
            )[0]
            == 200
        )
    assert (
        call(
            f"{url}/v1/groups/billing/retry", "POST", {"topic": "orders", "queue": 0, "offset": 0}
        )[0]
        == 200
    )
    return {
        "plain": plain[5]["msg_id"],
        "level": delayed[0]["msg_id"],
        "timer": timers[0]["msg_id"],
        "cancel": timers[1]["msg_id"],
    }


def test_every_view_shows_the_api_and_acts_on_the_cluster(make_cluster: Any, browser: Any) -> None:
    cluster: LocalCluster = make_cluster(**FAST_ELECTIONS)
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(30)
    leader_url = cluster.http_url(leader)
    me = (leader + 1) % 3  # the page is served by a follower, which outlives the leader
    url = cluster.http_url(me)
    ids = seed(leader_url)
    cluster.wait_converged()
    tab = Page(browser, url)

    # Cluster
    page = tab.view("cluster")
    view = call(f"{url}/v1/admin/cluster")[1]
    assert page.get_attribute("#leader-id", "data-leader") == str(view["leader"])
    assert tab.text("#leader-url .value") == cluster.http_url(leader)
    for n in view["nodes"]:
        row = f'#nodes-table tr[data-node="{n["id"]}"]'
        assert page.locator(f"{row} td").nth(1).inner_text().strip() == n["role"]
        assert num(page.locator(f"{row} td").nth(2).inner_text()) == n["term"]
        assert page.locator(f"{row} td.ready").inner_text().strip() == "yes"
        assert page.locator(f"{row} td").nth(10).inner_text().strip() == n["http_url"]
    assert "node" in tab.text("#cluster-timeline")
    tab.shot("cluster")

    # Topics
    page = tab.view("topics")
    topics = {t["topic"]: t for t in call(f"{url}/v1/topics")[1]["topics"]}
    assert (
        num(tab.text('#topics-table tr[data-topic="orders"] td:nth-child(3)'))
        == (topics["orders"]["messages"])
    )
    assert page.get_attribute("#queues-table", "data-topic") == "orders"
    for q in call(f"{url}/v1/topics/orders")[1]["queues"]:
        row = f'#queues-table tr[data-queue="{q["queue"]}"]'
        assert num(tab.text(f"{row} td.min")) == q["min_offset"]
        assert num(tab.text(f"{row} td.max")) == q["max_offset"]
    page.wait_for_function(  # the second read gives a rate
        "() => document.querySelector('#topics-table tr[data-topic=\"orders\"] td.rate')"
        ".textContent !== '–'"
    )
    tab.shot("topics")

    # Consumer groups
    page = tab.view("groups")
    (billing,) = call(f"{url}/v1/groups")[1]["groups"]
    for q in billing["queues"]:
        row = f'article[data-group="billing"] tr[data-topic="{q["topic"]}"][data-queue="{q["queue"]}"]'
        assert num(tab.text(f"{row} td.offset")) == q["offset"]
        assert num(tab.text(f"{row} td.lag")) == q["lag"]
    assert "%RETRY%billing" in tab.text('article[data-group="billing"]')
    assert "%DLQ%billing" in tab.text('article[data-group="billing"]')
    tab.shot("groups")

    # Delay levels: the table, then switch to async with a confirmation (declined once).
    page = tab.view("levels")
    sched = call(f"{url}/v1/admin/schedule")[1]
    assert tab.text("#schedule-mode") == sched["mode"] == "sync"
    for lv in sched["levels"]:
        assert (
            num(tab.text(f'#levels-table tr[data-level="{lv["level"]}"] td.backlog'))
            == (lv["backlog"])
        )
    assert num(tab.text('#levels-table tr[data-level="18"] td.backlog')) == 1
    tab.shot("levels")
    page.click("#switch-mode")
    page.wait_for_selector("#confirm-dialog[open]")
    tab.shot("levels-confirm")
    page.click("#confirm-cancel")
    assert tab.text("#levels-result") == "Nothing changed."
    assert call(f"{leader_url}/v1/admin/schedule")[1]["mode"] == "sync"
    page.click("#switch-mode")
    page.click("#confirm-ok")
    page.wait_for_function("() => document.querySelector('#schedule-mode').textContent === 'async'")
    for i in range(3):
        until(
            lambda i=i: call(f"{cluster.http_url(i)}/v1/admin/schedule")[1]["mode"] == "async",
            f"async mode on node {i}",
        )

    # Timers: figures and histogram as the API gives them; cancel one from the page.
    page = tab.view("timers")
    timer = call(f"{url}/v1/admin/timer")[1]
    hist = call(f"{url}/v1/admin/timer/histogram")[1]
    assert page.get_attribute("#timer-backlog", "data-value") == str(timer["backlog"]["total"])
    assert page.get_attribute("#timer-due-hour", "data-value") == str(hist["total"]) == "8"
    assert page.locator("svg.histogram rect.bar").count() == len(hist["buckets"])
    drawn = [
        int(b)
        for b in page.locator("svg.histogram rect.bar").evaluate_all(
            "bars => bars.map(b => b.dataset.messages)"
        )
    ]
    assert drawn == [b["messages"] for b in hist["buckets"]]
    tab.shot("timers")
    page.fill("#cancel-id", ids["cancel"])
    page.click("#cancel-button")
    page.click("#confirm-ok")
    page.wait_for_selector("#cancel-answer.cancelled")
    shown = json.loads(tab.text("#cancel-answer"))
    assert shown["msg_id"] == ids["cancel"] and shown["status"] == "cancelled"
    assert set(shown) == {"msg_id", "status", "reason", "deliver_ms"}
    tab.shot("timers-cancelled")
    for i in range(3):
        until(
            lambda i=i: (
                call(f"{cluster.http_url(i)}/v1/messages/{ids['cancel']}")[1].get("status")
                == "cancelled"
            ),
            f"the cancel on node {i}",
        )

    # Messages: by id (a level message waiting) and by key.
    page = tab.view("messages")
    page.fill("#lookup-id", ids["level"])
    page.click("#lookup-id-button")
    page.wait_for_selector(f'article.message[data-msg-id="{ids["level"]}"]')
    found = call(f"{url}/v1/messages/{ids['level']}")[1]
    assert page.get_attribute("article.message", "data-status") == found["status"] == "waiting"
    assert "delay level 18: SCHEDULE_TOPIC_XXXX queue 17" in tab.text('dd[data-field="waits in"]')
    assert "in 1.9 h" in tab.text('dd[data-field="due"]') or "in 2.0 h" in tab.text(
        'dd[data-field="due"]'
    )
    page.fill("#lookup-topic", "orders")
    page.fill("#lookup-key", "invoice")
    page.click("#lookup-key-button")
    page.wait_for_selector("article.message >> nth=7")
    by_key = call(f"{url}/v1/topics/orders/messages?key=invoice")[1]
    assert page.locator("article.message").count() == len(by_key["messages"]) == 8
    statuses = page.locator("article.message").evaluate_all("a => a.map(x => x.dataset.status)")
    assert sorted(statuses) == sorted(m["status"] for m in by_key["messages"])
    assert "cancelled" in statuses
    tab.shot("messages")
    page.fill("#lookup-id", ids["timer"])
    page.click("#lookup-id-button")
    page.wait_for_selector(f'article.message[data-msg-id="{ids["timer"]}"]')
    assert "timer wheel slot" in tab.text('dd[data-field="waits in"]')

    # Failover: SIGKILL the leader; the cluster view (on a follower) names the new one in 2 s.
    page = tab.view("cluster")
    assert page.get_attribute("#leader-id", "data-leader") == str(leader)
    killed_at = time.monotonic()
    cluster.kill(leader)
    page.wait_for_function(
        f"() => {{ const l = document.querySelector('#leader-id');"
        f" return l && l.dataset.leader !== '' && l.dataset.leader !== '{leader}'; }}",
        timeout=10_000,
        polling=20,
    )
    shown_after_s = time.monotonic() - killed_at
    new_leader = int(page.get_attribute("#leader-id", "data-leader") or "-1")
    assert new_leader in {i for i in range(3) if i != leader}
    assert call(f"{url}/v1/admin/cluster")[1]["leader"] == new_leader
    assert shown_after_s < 2.0, f"the console named the new leader {shown_after_s:.2f} s after"
    page.wait_for_selector(f'#nodes-table tr[data-node="{leader}"].down')
    tab.shot("cluster-failover")
    assert not tab.errors, tab.errors
    tab.context.close()


def test_the_console_asks_for_the_token_and_keeps_it_for_the_tab(
    make_cluster: Any, browser: Any
) -> None:
    cluster: LocalCluster = make_cluster(auth_token=TOKEN)
    cluster.wait_leader(60)
    url = cluster.http_url(0)
    tab = Page(browser, url)
    page = tab.page
    page.goto(f"{url}/console#cluster")
    page.wait_for_selector("#token-dialog[open]")
    assert page.locator("main[data-loaded]").count() == 0
    tab.shot("token")
    page.fill("#token-input", TOKEN)
    page.click("#token-ok")
    page.wait_for_selector('main[data-loaded="cluster"]')
    assert page.evaluate("sessionStorage.getItem('chronomq.token')") == TOKEN
    assert page.evaluate("localStorage.length") == 0
    # A reload in the same tab keeps it; another tab asks again.
    page.reload()
    page.wait_for_selector('main[data-loaded="cluster"]')
    assert page.locator("#token-dialog[open]").count() == 0
    other = Page(browser, url)
    other.page.goto(f"{url}/console#topics")
    other.page.wait_for_selector("#token-dialog[open]")
    assert not tab.errors and not other.errors, (tab.errors, other.errors)
    # A wrong token is refused and asked again.
    other.page.fill("#token-input", "wrong")
    other.page.click("#token-ok")
    other.page.wait_for_function(
        "() => document.querySelector('#token-error').textContent.includes('refused')"
    )
    assert other.page.locator("#token-dialog[open]").count() == 1
    tab.context.close()
    other.context.close()
