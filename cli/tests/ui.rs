//! `pgbus ui`, the dashboard, driven by a real browser (headless Chromium through
//! chromedriver, both started by the test) and by raw HTTP, against a real PostgreSQL and
//! real `pgbus consume` processes.
//!
//! The screenshots of the overview and of a subscription's page are written to
//! `$PGBUS_UI_SCREENSHOTS` when set (e.g. `docs/`), else under the target directory.

mod common;
mod dashboard;
mod proc;

use std::path::PathBuf;

use dashboard::{Ui, browser, csrf_cookie, follow_pages, http, js, post_form};
use fantoccini::{Client, Locator};
use pgbus::Event;
use pgbus_testkit::browser::Chromedriver;
use proc::{Consumer, WAIT};
use serde_json::{Value, json};

/// The overview's rows as the page shows them: name, health and the counts' text.
async fn overview_rows(browser: &Client) -> Vec<Value> {
    let rows = js(
        browser,
        "return [...document.querySelectorAll('#subs tbody tr')].map(r => ({
            name: r.dataset.name, health: r.className,
            due: r.querySelector('.due').textContent,
            dead: r.querySelector('.dead').textContent,
            blocked: r.querySelector('.blocked').textContent,
            consumers: r.querySelector('.consumers').textContent }));",
    )
    .await;
    rows.as_array().cloned().unwrap_or_default()
}

/// Waits until the overview (updated by its script, no reload) shows `name`'s row with
/// `field` equal to `want`.
async fn wait_overview(browser: &Client, name: &str, field: &str, want: &str) {
    let what = format!("the overview to show {name}'s {field} = {want}");
    common::wait_for(&what, WAIT, || async {
        overview_rows(browser)
            .await
            .iter()
            .any(|r| r["name"] == name && r[field] == want)
    })
    .await;
}

/// Goes where the overview's link `selector` leads, by its address: the overview's
/// script redraws its rows every second, so a click on an element found a moment before
/// could find it replaced.
async fn follow(browser: &Client, selector: &str) {
    let href = js(
        browser,
        &format!("return document.querySelector('{selector}').href;"),
    )
    .await;
    let href = href
        .as_str()
        .unwrap_or_else(|| panic!("no link {selector}"));
    browser.goto(href).await.unwrap();
}

/// Reloads `url` until `script` returns true.
async fn wait_page(browser: &Client, url: &str, what: &str, script: &str) {
    common::wait_for(what, WAIT, || async {
        browser.goto(url).await.unwrap();
        js(browser, script).await == Value::Bool(true)
    })
    .await;
}

/// Where the screenshots go.
fn screenshot_dir() -> PathBuf {
    let dir = std::env::var_os("PGBUS_UI_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ui-screenshots"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn screenshot(browser: &Client, name: &str) {
    let png = browser.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    let path = screenshot_dir().join(name);
    std::fs::write(&path, png).unwrap();
    eprintln!("screenshot: {}", path.display());
}

/// A shell command for `--exec` that fails with `error` while `flag` exists.
fn fail_while(flag: &std::path::Path, error: &str) -> String {
    format!(
        "if [ -e '{}' ]; then echo '{error}' >&2; exit 1; fi",
        flag.display()
    )
}

#[tokio::test]
async fn the_dashboard_follows_the_bus_and_its_actions_work() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let scratch = proc::scratch("ui");
    let mail_down = scratch.join("mail-down");
    let ledger_down = scratch.join("ledger-down");
    std::fs::write(&mail_down, "").unwrap();
    std::fs::write(&ledger_down, "").unwrap();
    // audit has no consumer: what is published to it waits.
    pgbus::admin::register_subscription(&client, "audit", &["audit.*"], 25)
        .await
        .unwrap();
    let mail_cmd = fail_while(&mail_down, "mail server down");
    let _mailer = Consumer::start(
        &db,
        &[
            "-s",
            "mailer",
            "-p",
            "mail.*",
            "--max-attempts",
            "1",
            "--exec",
            &mail_cmd,
        ],
    )
    .await;
    let ledger_cmd = format!(
        "if [ \"$PGBUS_EVENT_NAME\" = ledger.bad ]; then {}; fi",
        fail_while(&ledger_down, "ledger rejects it")
    );
    let _ledger = Consumer::start(
        &db,
        &[
            "-s",
            "ledger",
            "-p",
            "ledger.*",
            "--ordered",
            "--on-dead",
            "block",
            "--max-attempts",
            "1",
            "--exec",
            &ledger_cmd,
        ],
    )
    .await;
    let ui = Ui::start(&db, &["--allow-actions"], &[]).await;
    let driver = Chromedriver::start().await.unwrap();
    let browser = browser(&driver).await;

    // The overview, live: counts change after a publish without a reload.
    browser.goto(&ui.url("/")).await.unwrap();
    wait_overview(&browser, "audit", "due", "0").await;
    common::wait_for("the overview to show mailer's consumer", WAIT, || async {
        overview_rows(&browser).await.iter().any(|r| {
            r["name"] == "mailer"
                && (r["consumers"] == "1 awake / 0 asleep"
                    || r["consumers"] == "0 awake / 1 asleep")
        })
    })
    .await;
    let loaded_at = js(&browser, "return performance.timeOrigin;").await;
    pgbus::publish(&client, &Event::new("audit.login", json!({ "user": 7 })))
        .await
        .unwrap();
    wait_overview(&browser, "audit", "due", "1").await;
    wait_overview(&browser, "audit", "health", "behind").await;
    let mail = Event::new("mail.send", json!({ "to": "ops@example.com" }));
    let mail_id = mail.id.clone();
    pgbus::publish(&client, &mail).await.unwrap();
    wait_overview(&browser, "mailer", "dead", "1").await;
    wait_overview(&browser, "mailer", "health", "failing").await;
    assert_eq!(
        js(&browser, "return performance.timeOrigin;").await,
        loaded_at,
        "the overview updated without a reload"
    );
    // A few more samples for the charts, then the picture.
    for i in 0..20 {
        pgbus::publish(
            &client,
            &Event::new("ledger.ok", json!({ "n": i })).aggregate("acct", format!("{i}")),
        )
        .await
        .unwrap();
    }
    common::wait_for("the overview to show ledger's throughput", WAIT, || async {
        js(
            &browser,
            "const r = document.querySelector('#subs tr[data-name=ledger] .rate');
             return r !== null && Number(r.textContent) > 0;",
        )
        .await
            == Value::Bool(true)
    })
    .await;
    screenshot(&browser, "ui-overview.png").await;

    // A dead letter: opened, its failure history shown, retried by a click, delivered.
    follow(&browser, "#subs tr[data-name=mailer] td.name a").await;
    let dead_letter = browser
        .find(Locator::Css("details.dead-letter"))
        .await
        .unwrap();
    dead_letter
        .find(Locator::Css("summary"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let history = dead_letter
        .find(Locator::Css("table.history"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(history.contains("mail server down"), "{history}");
    let worker: String = client
        .query_one(
            "SELECT id FROM pgbus.consumers WHERE 'mailer' = ANY (subscriptions)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(history.contains(&worker), "the worker is named: {history}");
    assert_eq!(
        dead_letter.attr("data-event-id").await.unwrap().as_deref(),
        Some(mail_id.as_str())
    );
    screenshot(&browser, "ui-subscription.png").await;
    std::fs::remove_file(&mail_down).unwrap();
    dead_letter
        .find(Locator::Css("button.retry"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let done = after_action(&browser).await;
    assert_eq!(done.text().await.unwrap(), "retried 1 dead letter");
    let event_page = ui.url(&format!("/events?q={mail_id}"));
    wait_page(
        &browser,
        &event_page,
        "the retried dead letter to be delivered",
        "const s = document.querySelector('.delivery[data-subscription=mailer] .status');
         return s !== null && s.textContent === 'done';",
    )
    .await;
    let history = browser
        .find(Locator::Css(
            ".delivery[data-subscription=mailer] table.history",
        ))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(history.contains("mail server down"), "{history}");
    let payload = browser
        .find(Locator::Css("pre.payload"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(&payload).unwrap(),
        json!({ "to": "ops@example.com" })
    );

    // A blocked key, skipped by a click: what waited behind it is delivered.
    let bad = Event::new("ledger.bad", json!({})).aggregate("acct", "x");
    let bad_id = bad.id.clone();
    let behind = Event::new("ledger.ok", json!({ "after": "bad" })).aggregate("acct", "x");
    let behind_id = behind.id.clone();
    pgbus::publish_batch(&client, &[bad, behind]).await.unwrap();
    let ledger_page = ui.url("/subscriptions/ledger");
    wait_page(
        &browser,
        &ledger_page,
        "the key acct:x to be blocked with one delivery behind it",
        "const r = document.querySelector('#blocked tr[data-key=\"acct:x\"] .waiting');
         return r !== null && r.textContent === '1';",
    )
    .await;
    let behind_listed = browser
        .find(Locator::Css(
            "#blocked tr[data-key=\"acct:x\"] ul.behind li",
        ))
        .await
        .unwrap();
    assert_eq!(
        behind_listed
            .attr("data-event-id")
            .await
            .unwrap()
            .as_deref(),
        Some(behind_id.as_str()),
        "what waits behind the key is listed"
    );
    browser
        .find(Locator::Css("#blocked tr[data-key=\"acct:x\"] button.skip"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let done = after_action(&browser).await;
    assert_eq!(
        done.text().await.unwrap(),
        format!(
            "skipped the dead head of key acct:x (event {bad_id}); event {behind_id} is its head now"
        )
    );
    // The same Skip sent again (the form resubmitted): the head it showed is gone, so
    // nothing is skipped, and the answer says why.
    let (again, _) = post_form(
        &ui,
        "/subscriptions/ledger/keys/skip",
        &format!("key=acct%3Ax&event_id={bad_id}"),
    )
    .await;
    assert_eq!(again.status, 409, "{again:?}");
    assert!(
        again
            .body
            .contains("key acct:x changed since you loaded the page"),
        "{}",
        again.body
    );
    assert_eq!(
        common::count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE subscription = 'ledger' \
             AND status = 'dead' AND NOT is_head"
        )
        .await,
        1,
        "only the head the page showed was skipped"
    );
    wait_page(
        &browser,
        &ui.url(&format!("/events?q={behind_id}")),
        "the delivery behind the skipped head to be delivered",
        "const s = document.querySelector('.delivery[data-subscription=ledger] .status');
         return s !== null && s.textContent === 'done';",
    )
    .await;
    browser.goto(&ledger_page).await.unwrap();
    assert_eq!(
        browser
            .find_all(Locator::Css("#blocked tr[data-key]"))
            .await
            .unwrap()
            .len(),
        0,
        "no key is blocked any more"
    );

    // The consumers page lists both buses.
    browser.goto(&ui.url("/consumers")).await.unwrap();
    let consumers = browser
        .find(Locator::Css("#consumer-list"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        consumers.contains("mailer") && consumers.contains("ledger"),
        "{consumers}"
    );
    browser.close().await.unwrap();
}

/// A request the dashboard must refuse: what it lacks, its headers, its form.
type Refused<'a> = (&'a str, Vec<(&'a str, &'a str)>, String);

#[tokio::test]
async fn actions_need_the_token_the_cookie_and_the_same_origin() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "jobs", &["p.*"], 3)
        .await
        .unwrap();
    proc::two_dead_letters(&client).await;
    let dead = || async {
        common::count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE status = 'dead'",
        )
        .await
    };
    let ui = Ui::start(&db, &["--allow-actions"], &[]).await;
    let token = csrf_cookie(&ui, &[]).await;
    let page = http(ui.addr, "GET", "/subscriptions/jobs", &[], "").await;
    assert!(
        page.body
            .contains(&format!("name=\"csrf\" value=\"{token}\"")),
        "the page's forms carry the token"
    );
    for header in [
        "content-security-policy",
        "x-content-type-options",
        "x-frame-options",
    ] {
        assert!(page.header(header).is_some(), "{header} in {}", page.head);
    }
    assert!(
        page.header("content-security-policy")
            .unwrap()
            .contains("script-src 'self'")
    );
    // A page of another site whose name resolves to the loopback address (DNS
    // rebinding) reaches the dashboard with its own name as the host: refused.
    let rebound = format!("rebound.example:{}", ui.addr.port());
    let answer = http(ui.addr, "GET", "/api/overview", &[("Host", &rebound)], "").await;
    assert_eq!(answer.status, 421, "{answer:?}");
    let localhost = format!("localhost:{}", ui.addr.port());
    let answer = http(ui.addr, "GET", "/api/overview", &[("Host", &localhost)], "").await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let cookie = format!("pgbus_csrf={token}");
    let origin = format!("http://{}", ui.addr);
    let form = format!("csrf={token}&event_id=e1");
    let refused: [Refused<'_>; 5] = [
        ("no token, no cookie", vec![], "event_id=e1".to_string()),
        (
            "the cookie alone",
            vec![("Cookie", &cookie)],
            "event_id=e1".to_string(),
        ),
        ("the form's token alone", vec![], form.clone()),
        (
            "a wrong token",
            vec![("Cookie", &cookie)],
            "csrf=0000&event_id=e1".to_string(),
        ),
        (
            "another site's origin",
            vec![("Cookie", &cookie), ("Origin", "http://evil.example")],
            form.clone(),
        ),
    ];
    for (what, headers, body) in &refused {
        let answer = http(ui.addr, "POST", "/subscriptions/jobs/retry", headers, body).await;
        assert_eq!(answer.status, 403, "{what}: {answer:?}");
        assert_eq!(dead().await, 2, "{what}: nothing was retried");
    }
    let referer = format!("http://evil.example/{}", ui.addr);
    let answer = http(
        ui.addr,
        "POST",
        "/subscriptions/jobs/retry",
        &[("Cookie", &cookie), ("Referer", &referer)],
        &form,
    )
    .await;
    assert_eq!(answer.status, 403, "another site's referer: {answer:?}");
    assert_eq!(dead().await, 2);
    // Purging needs its confirmation.
    let answer = http(
        ui.addr,
        "POST",
        "/subscriptions/jobs/purge",
        &[("Cookie", &cookie), ("Origin", &origin)],
        &format!("csrf={token}"),
    )
    .await;
    assert_eq!(answer.status, 400, "{answer:?}");
    assert_eq!(dead().await, 2);
    // Everything right: one dead letter retried.
    let answer = http(
        ui.addr,
        "POST",
        "/subscriptions/jobs/retry",
        &[("Cookie", &cookie), ("Origin", &origin)],
        &form,
    )
    .await;
    assert_eq!(answer.status, 303, "{answer:?}");
    // The outcome stays on the server: the address carries only its one-time id.
    let location = answer.header("location").unwrap().to_string();
    assert!(
        location.starts_with("/subscriptions/jobs?done="),
        "{answer:?}"
    );
    assert!(!location.contains("retried"), "{location}");
    assert_eq!(dead().await, 1);
    let page = http(ui.addr, "GET", &location, &[], "").await;
    assert!(
        page.body.contains(">retried 1 dead letter<"),
        "the outcome is shown: {}",
        page.body
    );
    let again = http(ui.addr, "GET", &location, &[], "").await;
    assert_eq!(again.status, 200);
    assert!(
        !again.body.contains("retried 1 dead letter"),
        "the outcome is shown once: {}",
        again.body
    );
    let answer = http(
        ui.addr,
        "POST",
        "/subscriptions/jobs/purge",
        &[("Cookie", &cookie), ("Origin", &origin)],
        &format!("csrf={token}&confirm=yes"),
    )
    .await;
    assert_eq!(answer.status, 303, "{answer:?}");
    assert_eq!(dead().await, 0);

    // Read-only: the same request with this process's token is refused.
    client
        .batch_execute("UPDATE pgbus.deliveries SET status = 'dead'")
        .await
        .unwrap();
    assert_eq!(dead().await, 1);
    let read_only = Ui::start(&db, &[], &[]).await;
    let token = csrf_cookie(&read_only, &[]).await;
    let cookie = format!("pgbus_csrf={token}");
    let answer = http(
        read_only.addr,
        "POST",
        "/subscriptions/jobs/retry",
        &[("Cookie", &cookie)],
        &format!("csrf={token}"),
    )
    .await;
    assert_eq!(answer.status, 403, "{answer:?}");
    assert!(answer.body.contains("--allow-actions"), "{}", answer.body);
    assert_eq!(dead().await, 1);
    let page = http(read_only.addr, "GET", "/subscriptions/jobs", &[], "").await;
    assert!(
        !page.body.contains("<form method=\"post\""),
        "no action is offered"
    );

    // Basic auth: every request needs the password, any user name.
    let guarded = Ui::start(&db, &[], &[("PGBUS_UI_PASSWORD", "s3cret")]).await;
    for path in ["/", "/api/overview", "/static/app.js"] {
        let answer = http(guarded.addr, "GET", path, &[], "").await;
        assert_eq!(answer.status, 401, "{path}: {answer:?}");
        assert!(
            answer
                .header("www-authenticate")
                .unwrap()
                .starts_with("Basic")
        );
    }
    // "anyone:wrong", "anyone:s3cret"
    let wrong = http(
        guarded.addr,
        "GET",
        "/",
        &[("Authorization", "Basic YW55b25lOndyb25n")],
        "",
    )
    .await;
    assert_eq!(wrong.status, 401);
    let right = [("Authorization", "Basic YW55b25lOnMzY3JldA==")];
    let answer = http(guarded.addr, "GET", "/api/overview", &right, "").await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let overview: Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(overview["subscriptions"][0]["name"], "jobs");
    assert_eq!(overview["subscriptions"][0]["dead"], 1);
}

#[tokio::test]
async fn what_events_carry_is_shown_as_text_and_never_runs() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let sub = "x\"><img/src=x/onerror=window.__xss=1>";
    let name = "xss.\"><script>window.__xss=2</script>";
    pgbus::admin::register_subscription(&client, sub, &["xss.*"], 25)
        .await
        .unwrap();
    let event = Event::new(
        name,
        json!({
            "html": "<script>window.__xss=3</script>",
            "attr": "\"><img src=x onerror=window.__xss=4>",
        }),
    )
    .header("h", "<img src=x onerror=window.__xss=5>")
    .correlation_id("\"><b id=injected>corr</b>")
    .aggregate("<i>t</i>", "1");
    let id = event.id.clone();
    pgbus::publish(&client, &event).await.unwrap();
    common::fan_out(&client).await;
    let error = "<img src=x onerror=window.__xss=6>";
    client
        .execute(
            "WITH d AS (UPDATE pgbus.deliveries SET status = 'dead', attempts = 1, last_error = $1 \
             RETURNING subscription, event_seq) \
             INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error, worker) \
             SELECT subscription, event_seq, 1, $1, $1 FROM d",
            &[&error],
        )
        .await
        .unwrap();
    let ui = Ui::start(&db, &["--allow-actions"], &[]).await;
    let driver = Chromedriver::start().await.unwrap();
    let browser = browser(&driver).await;
    // Nothing injected: no element the content names, no script but the dashboard's, and
    // no handler ran.
    let clean = "return typeof window.__xss === 'undefined'
        && document.querySelectorAll('img, b, i, svg, iframe').length === 0
        && [...document.scripts].every(s => s.src.endsWith('/static/app.js'))
        && document.getElementById('injected') === null;";

    browser.goto(&ui.url("/")).await.unwrap();
    common::wait_for(
        "the overview's script to have refreshed it",
        WAIT,
        || async {
            js(
                &browser,
                "return document.body.dataset.refreshed !== undefined;",
            )
            .await
                == Value::Bool(true)
        },
    )
    .await;
    let rows = overview_rows(&browser).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["name"], sub);
    let link = browser.find(Locator::Css("#subs td.name a")).await.unwrap();
    assert_eq!(link.text().await.unwrap(), sub);
    assert_eq!(js(&browser, clean).await, Value::Bool(true), "the overview");

    // Followed by its address: the script redraws the rows every second, so a click on
    // the element found above could find it replaced.
    follow(&browser, "#subs td.name a").await;
    assert_eq!(
        browser
            .find(Locator::Id("name"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
        sub
    );
    let dead_letter = browser
        .find(Locator::Css("details.dead-letter"))
        .await
        .unwrap();
    dead_letter
        .find(Locator::Css("summary"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let text = dead_letter.text().await.unwrap();
    assert!(text.contains(name), "{text}");
    assert!(text.contains(error), "{text}");
    assert_eq!(
        js(&browser, clean).await,
        Value::Bool(true),
        "the subscription's page"
    );

    browser
        .goto(&ui.url(&format!("/events?q={id}")))
        .await
        .unwrap();
    let section = browser.find(Locator::Css("section.event")).await.unwrap();
    let text = section.text().await.unwrap();
    for shown in [name, "\"><b id=injected>corr</b>", "<i>t</i>", error] {
        assert!(text.contains(shown), "{shown:?} in {text}");
    }
    let payload = browser
        .find(Locator::Css("pre.payload"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(&payload).unwrap(),
        event.payload,
        "the payload, pretty-printed, reads back as itself"
    );
    let headers = browser
        .find(Locator::Css("pre.headers"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        headers.contains("<img src=x onerror=window.__xss=5>"),
        "{headers}"
    );
    assert_eq!(
        js(&browser, clean).await,
        Value::Bool(true),
        "the event's page"
    );

    // Found by its correlation id too.
    let q = "%22%3E%3Cb%20id%3Dinjected%3Ecorr%3C%2Fb%3E";
    browser
        .goto(&ui.url(&format!("/events?q={q}")))
        .await
        .unwrap();
    assert_eq!(
        browser
            .find_all(Locator::Css("section.event"))
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        js(&browser, clean).await,
        Value::Bool(true),
        "the search's page"
    );
    browser.close().await.unwrap();
}

/// The overview counts the events committed and not yet turned into deliveries (no bus
/// runs here, so none is), apart from every subscription's counts; once a batch is cut,
/// they are the subscription's due deliveries.
#[tokio::test]
async fn the_overview_counts_events_not_yet_turned_into_deliveries() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "audit", &["audit.*"], 25)
        .await
        .unwrap();
    for user in 0..2 {
        pgbus::publish(&client, &Event::new("audit.login", json!({ "user": user })))
            .await
            .unwrap();
    }
    let ui = Ui::start(&db, &[], &[]).await;
    let overview = || async {
        let answer = http(ui.addr, "GET", "/api/overview", &[], "").await;
        assert_eq!(answer.status, 200, "{answer:?}");
        serde_json::from_str::<Value>(&answer.body).unwrap()
    };
    common::wait_for("the overview to count the two events", WAIT, || async {
        let o = overview().await;
        o["not_fanned_out"] == 2 && o["subscriptions"][0]["due"] == 0
    })
    .await;
    common::fan_out(&client).await;
    common::wait_for("the overview to show them as due", WAIT, || async {
        let o = overview().await;
        o["not_fanned_out"] == 0 && o["subscriptions"][0]["due"] == 2
    })
    .await;
}

#[tokio::test]
async fn a_database_outage_shows_as_a_banner_and_the_dashboard_keeps_serving() {
    let (cluster, config) = common::private_cluster().await;
    let ui = Ui::start_on(&common::conninfo(&config), &[], &[]).await;
    let answer = http(ui.addr, "GET", "/api/overview", &[], "").await;
    assert_eq!(answer.status, 200, "{answer:?}");
    drop(cluster);
    common::wait_for("the overview to report the outage", WAIT, || async {
        let answer = http(ui.addr, "GET", "/api/overview", &[], "").await;
        let overview: Value = serde_json::from_str(&answer.body).unwrap();
        overview["error"].is_string()
    })
    .await;
    let page = http(ui.addr, "GET", "/", &[], "").await;
    assert_eq!(page.status, 200);
    assert!(
        page.body.contains("The database cannot be read"),
        "{}",
        page.body
    );
    let page = http(ui.addr, "GET", "/subscriptions/x", &[], "").await;
    assert_eq!(page.status, 503, "{page:?}");
}

#[tokio::test]
async fn bad_input_starts_nothing_and_a_taken_address_fails() {
    let db = common::test_db().await;
    for (args, env, what) in [
        (vec!["ui", "--listen", "localhost"], vec![], "no port"),
        (vec!["ui", "--listen", "1.2.3.4.5:80"], vec![], "a bad IP"),
        (
            vec!["ui", "--interval", "10ms"],
            vec![],
            "too short an interval",
        ),
        (
            vec!["ui"],
            vec![("PGBUS_UI_PASSWORD", "")],
            "an empty password",
        ),
        (
            vec!["ui", "--max-connections", "0"],
            vec![],
            "no connection",
        ),
        (
            vec!["ui", "--max-connections-per-ip", "0"],
            vec![],
            "no connection per address",
        ),
        (
            vec!["ui", "--header-timeout", "0s"],
            vec![],
            "no time for a head",
        ),
        (
            vec!["ui", "--request-timeout", "1ms"],
            vec![],
            "too short a request timeout",
        ),
        (
            vec!["ui", "--listen", "0.0.0.0:0"],
            vec![],
            "off loopback without a password",
        ),
    ] {
        let mut cmd = proc::pgbus_on(&db);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = proc::run(cmd, &args).await;
        assert_eq!(out.code, 2, "{what}: {out:?}");
        assert!(!out.stderr.contains("dashboard on"), "{what}: {out:?}");
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = proc::run(proc::pgbus_on(&db), &["ui", "--listen", &addr]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("cannot listen on"), "{out:?}");
    let out = proc::run(
        proc::pgbus(),
        &["ui", "--database-url", "postgres://nobody@127.0.0.1:1/none"],
    )
    .await;
    assert_eq!(out.code, 1, "an unreachable database: {out:?}");
}

/// The outcome of an action whose button was just clicked: the form's POST loads a new
/// page, so the outcome is waited for (a find right after the click can still see the
/// old page).
async fn after_action(browser: &fantoccini::Client) -> fantoccini::elements::Element {
    browser
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Id("done"))
        .await
        .expect("the action's outcome on the page that its POST loads")
}

/// Pausing from a subscription's page holds a running consumer's deliveries (made, not
/// one attempt), the overview shows the subscription as paused, a resubmitted Pause
/// changes nothing and says so, and Resume delivers what waited: an unordered and an
/// ordered subscription, the ordered one in its key's order.
#[tokio::test]
async fn pausing_from_the_dashboard_holds_running_consumers_and_resuming_delivers() {
    let db = common::test_db().await;
    let client = db.connect().await;
    let mut mailer = Consumer::start(&db, &["-s", "mailer", "-p", "mail.*"]).await;
    let mut ledger = Consumer::start(&db, &["-s", "ledger", "-p", "ledger.*", "--ordered"]).await;
    let ui = Ui::start(&db, &["--allow-actions"], &[]).await;
    let driver = Chromedriver::start().await.unwrap();
    let browser = browser(&driver).await;

    for name in ["mailer", "ledger"] {
        browser
            .goto(&ui.url(&format!("/subscriptions/{name}")))
            .await
            .unwrap();
        browser
            .find(Locator::Id("pause"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let done = after_action(&browser).await;
        assert_eq!(
            done.text().await.unwrap(),
            format!("paused {name}: its deliveries wait until it is resumed")
        );
        let state = browser.find(Locator::Id("state")).await.unwrap();
        assert_eq!(state.text().await.unwrap(), "paused");
        browser.find(Locator::Id("resume")).await.unwrap();
    }
    for n in 0..3 {
        pgbus::publish(&client, &Event::new("mail.send", json!({ "n": n })))
            .await
            .unwrap();
        pgbus::publish(
            &client,
            &Event::new("ledger.ok", json!({ "n": n })).aggregate("acct", "1"),
        )
        .await
        .unwrap();
    }
    browser.goto(&ui.url("/")).await.unwrap();
    wait_overview(&browser, "mailer", "health", "paused").await;
    wait_overview(&browser, "mailer", "due", "3").await;
    wait_overview(&browser, "ledger", "health", "paused").await;
    wait_overview(&browser, "ledger", "due", "3").await;
    assert_eq!(
        common::count(
            &client,
            "SELECT count(*) FROM pgbus.deliveries WHERE attempts > 0 OR status <> 'pending'"
        )
        .await,
        0,
        "a paused subscription's delivery was claimed"
    );

    // A Pause sent again from a page loaded before the pause: nothing changes, and the
    // answer says so.
    let (again, cookie) = post_form(&ui, "/subscriptions/mailer/pause", "").await;
    assert_eq!(again.status, 303, "{again:?}");
    let location = again.header("location").unwrap().to_string();
    let shown = http(ui.addr, "GET", &location, &[("Cookie", &cookie)], "").await;
    assert!(
        shown.body.contains("mailer was already paused"),
        "{}",
        shown.body
    );

    for name in ["mailer", "ledger"] {
        browser
            .goto(&ui.url(&format!("/subscriptions/{name}")))
            .await
            .unwrap();
        browser
            .find(Locator::Id("resume"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let done = after_action(&browser).await.text().await.unwrap();
        assert!(
            done.starts_with(&format!("resumed {name} (paused since ")),
            "{done}"
        );
    }
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(ledger.next().await["payload"]["n"].as_i64().unwrap());
    }
    assert_eq!(got, [0, 1, 2], "the ordered key out of order");
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(mailer.next().await["payload"]["n"].as_i64().unwrap());
    }
    got.sort_unstable();
    assert_eq!(got, [0, 1, 2]);
    browser.goto(&ui.url("/")).await.unwrap();
    wait_overview(&browser, "mailer", "health", "healthy").await;
    browser.close().await.unwrap();
}

/// Every one of 120 dead letters is reachable from the subscription's page by following
/// its "next" links, each once, oldest first, with when it died; a bad place in the
/// listing is refused (400).
#[tokio::test]
async fn every_dead_letter_is_reached_by_following_the_pages() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "jobs", &["j.*"], 1)
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO pgbus.events (id, event_name, payload) \
             SELECT 'job-' || lpad(g::text, 3, '0'), 'j.x', '{}' FROM generate_series(1, 120) AS g",
        )
        .await
        .unwrap();
    common::fan_out(&client).await;
    client
        .batch_execute(
            "UPDATE pgbus.deliveries SET status = 'dead', attempts = 1, last_error = 'boom'; \
             INSERT INTO pgbus.delivery_failures (subscription, event_seq, attempt, error, worker) \
             SELECT subscription, event_seq, 1, 'boom', 'w' FROM pgbus.deliveries",
        )
        .await
        .unwrap();
    let ui = Ui::start(&db, &[], &[]).await;
    let marker = "class=\"dead-letter\" data-event-id=\"";
    let pages = follow_pages(&ui, "/subscriptions/jobs", "dead-next", 3).await;
    assert_eq!(pages.len(), 3);
    let mut seen: Vec<String> = Vec::new();
    for (n, body) in pages.iter().enumerate() {
        let on_page: Vec<String> = body
            .match_indices(marker)
            .map(|(i, m)| {
                let rest = &body[i + m.len()..];
                rest[..rest.find('"').unwrap()].to_owned()
            })
            .collect();
        assert!(!on_page.is_empty(), "page {n} lists no dead letter");
        assert!(
            body.contains("class=\"died-at\""),
            "page {n} says not when they died"
        );
        seen.extend(on_page);
    }
    let expected: Vec<String> = (1..=120).map(|i| format!("job-{i:03}")).collect();
    assert_eq!(seen, expected, "each dead letter once, oldest first");
    let bad = http(
        ui.addr,
        "GET",
        "/subscriptions/jobs?after=nonsense",
        &[],
        "",
    )
    .await;
    assert_eq!(bad.status, 400, "{bad:?}");
}

/// Every one of 120 pending deliveries is reachable from the subscription's page by
/// following its "next" links, each once, in event order, with its state: due,
/// scheduled (a delayed event) or waiting behind its key's head (an ordered key).
#[tokio::test]
async fn every_pending_delivery_is_reached_by_following_the_pages() {
    let db = common::test_db().await;
    let client = db.connect().await;
    pgbus::admin::register_subscription(&client, "jobs", &["j.*"], 25)
        .await
        .unwrap();
    pgbus::ordering::set_ordering(&client, "jobs", true, pgbus::DeadHeadPolicy::Block)
        .await
        .unwrap();
    // 118 due, unkeyed; then a key of two (its second waits); and one delayed.
    client
        .batch_execute(
            "INSERT INTO pgbus.events (id, event_name, payload) \
             SELECT 'job-' || lpad(g::text, 3, '0'), 'j.x', '{}' FROM generate_series(1, 117) AS g; \
             INSERT INTO pgbus.events (id, event_name, payload, ordering_key) \
             VALUES ('job-118', 'j.x', '{}', 'k'), ('job-119', 'j.x', '{}', 'k'); \
             INSERT INTO pgbus.events (id, event_name, payload, available_at) \
             VALUES ('job-120', 'j.x', '{}', now() + interval '1 hour')",
        )
        .await
        .unwrap();
    common::fan_out(&client).await;
    let ui = Ui::start(&db, &[], &[]).await;
    let marker = "class=\"pending\" data-event-id=\"";
    let pages = follow_pages(&ui, "/subscriptions/jobs", "pending-next", 3).await;
    assert_eq!(pages.len(), 3);
    let mut seen: Vec<(String, String)> = Vec::new();
    for body in &pages {
        for (i, m) in body.match_indices(marker) {
            let rest = &body[i + m.len()..];
            let id = rest[..rest.find('"').unwrap()].to_owned();
            let state_at = rest.find("data-state=\"").unwrap() + "data-state=\"".len();
            let state = rest[state_at..state_at + rest[state_at..].find('"').unwrap()].to_owned();
            seen.push((id, state));
        }
    }
    let ids: Vec<&str> = seen.iter().map(|(id, _)| id.as_str()).collect();
    let expected: Vec<String> = (1..=120).map(|i| format!("job-{i:03}")).collect();
    assert_eq!(ids, expected, "each pending delivery once, in event order");
    let state = |id: &str| seen.iter().find(|(i, _)| i == id).unwrap().1.clone();
    assert_eq!(state("job-001"), "due");
    assert_eq!(state("job-118"), "due", "the key's head");
    assert_eq!(state("job-119"), "waiting", "behind the key's head");
    assert_eq!(state("job-120"), "scheduled");
    let bad = http(
        ui.addr,
        "GET",
        "/subscriptions/jobs?pending_after=nonsense",
        &[],
        "",
    )
    .await;
    assert_eq!(bad.status, 400, "{bad:?}");
}
