//! The dashboard's pages, rendered with maud: every value is escaped for HTML, so the
//! names, headers, payloads and errors an application wrote show as text, and every
//! such text goes through [`Shown`], which writes invisible, bidirectional and control
//! characters as marked codes (`<U+202E>`). No inline script and no inline style: the
//! Content-Security-Policy allows neither.

use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};

use super::security::{Shown, plain};
use super::{EventView, Overview, SubscriptionRow, SubscriptionView, percent};
use pgbus::admin::{ConsumerInfo, FailedAttempt};

/// The frame of every page: the navigation, the search, and the script.
fn layout(title: &str, page: &str, allow_actions: bool, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (plain(title)) " · pgbus" }
                link rel="stylesheet" href="/static/style.css";
                script src="/static/app.js" defer {}
            }
            body data-page=(page) {
                header {
                    nav {
                        a.brand href="/" { "pgbus" }
                        a href="/" { "Overview" }
                        a href="/consumers" { "Consumers" }
                        form.search action="/events" method="get" {
                            input type="search" name="q" placeholder="event id or correlation id"
                                aria-label="event id or correlation id";
                            button type="submit" { "Find" }
                        }
                        span.mode { @if allow_actions { "actions allowed" } @else { "read-only" } }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// The page of an error.
pub(super) fn error_page(allow_actions: bool, status: StatusCode, message: &str) -> Markup {
    layout(
        "error",
        "error",
        allow_actions,
        html! {
            h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("error")) }
            div.banner.failing role="alert" { (Shown(message)) }
            p { a href="/" { "Back to the overview" } }
        },
    )
}

/// A count, marked as "at least" at the cap.
fn count(n: i64, cap: i64) -> String {
    if n >= cap {
        format!("{n}+")
    } else {
        n.to_string()
    }
}

/// An age in seconds, for people.
pub(super) fn age(seconds: Option<f64>) -> String {
    match seconds {
        None => "–".into(),
        Some(s) => super::human_duration(std::time::Duration::from_secs_f64(s.max(0.0))),
    }
}

fn time(at: &DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string()
}

fn subscription_href(name: &str) -> String {
    format!("/subscriptions/{}", percent(name))
}

fn event_href(id: &str) -> String {
    format!("/events?q={}", percent(id))
}

/// The overview's row of one subscription (the script rebuilds the same rows).
fn subscription_row(sub: &SubscriptionRow, cap: i64) -> Markup {
    html! {
        tr data-name=(sub.name) class=(sub.health) {
            td.name { a href=(subscription_href(&sub.name)) { (Shown(&sub.name)) } }
            td { span.health { (sub.health) } }
            td.due { (count(sub.due, cap)) }
            td.scheduled { (count(sub.scheduled, cap)) }
            td.processing { (count(sub.processing, cap)) }
            td.dead { (count(sub.dead, cap)) }
            td.blocked { (count(sub.blocked_keys, cap)) }
            td.age { (age(sub.oldest_due_age)) }
            td.consumers { (sub.consumers_awake) " awake / " (sub.consumers_asleep) " asleep" }
            td.rate { @if sub.throughput_estimated { "~" } (format!("{:.1}", sub.delivered_per_second)) }
            td.chart { canvas width="240" height="48" {} }
        }
    }
}

/// The overview: every subscription, the notification queue and the listeners.
pub(super) fn overview(allow_actions: bool, overview: &Overview) -> Markup {
    let cap = overview.count_cap;
    layout(
        "overview",
        "overview",
        allow_actions,
        html! {
            div #error.banner.failing role="alert" hidden[overview.error.is_none()] {
                @if let Some(e) = &overview.error { "The database cannot be read: " (Shown(e)) }
            }
            div #long-transaction.banner.behind role="alert" hidden[overview.long_transaction.is_none()] {
                @if let Some(t) = &overview.long_transaction { (Shown(t)) }
            }
            h1 { "Subscriptions" }
            p.cluster {
                "Notification queue: " span #queue { (format!("{:.2}%", overview.notification_queue_usage * 100.0)) }
                " · listening backends: " span #listeners { (overview.listeners) }
                " · consumers: " span #consumers { (overview.consumers) }
                " (" span #sleeping { (overview.sleeping_consumers) } " asleep)"
                " · events not yet turned into deliveries: " span #not-fanned-out { (overview.not_fanned_out) }
                " · sampled " span #sampled {
                    @if let Some(at) = &overview.sampled_at { (time(at)) } @else { "never" }
                }
            }
            table #subs {
                thead {
                    tr {
                        th { "Subscription" } th { "Health" } th { "Due" } th { "Scheduled" }
                        th { "Processing" } th { "Dead" } th { "Blocked keys" }
                        th { "Oldest due" } th { "Consumers" } th { "Delivered/s" }
                        th { "Delivered/s (green) and backlog (blue)" }
                    }
                }
                tbody {
                    @for sub in &overview.subscriptions { (subscription_row(sub, cap)) }
                }
            }
            p.legend {
                span.healthy { "healthy" } " nothing dead or blocked, nothing waiting long · "
                span.behind { "behind" } " the oldest due delivery waits over 30s, or due work has no consumer · "
                span.paused { "paused" } " its deliveries wait until it is resumed · "
                span.failing { "failing" } " dead letters or blocked keys"
            }
        },
    )
}

/// A hidden CSRF field.
fn csrf_field(token: &str) -> Markup {
    html! { input type="hidden" name="csrf" value=(token); }
}

/// A table of failed attempts.
fn failures_table(failures: &[FailedAttempt]) -> Markup {
    html! {
        @if failures.is_empty() {
            p.empty { "No failure recorded." }
        } @else {
            table.history {
                thead { tr { th { "Attempt" } th { "Failed at" } th { "Worker" } th { "Error" } } }
                tbody {
                    @for f in failures {
                        tr {
                            td { (f.attempt) }
                            td { (time(&f.failed_at)) }
                            td { (Shown(f.worker.as_deref().unwrap_or("(lease expired)"))) }
                            td { pre.error { (Shown(&f.error)) } }
                        }
                    }
                }
            }
        }
    }
}

/// A subscription's page: settings, counts, dead letters, blocked keys, actions.
pub(super) fn subscription(
    allow_actions: bool,
    csrf: &str,
    view: &SubscriptionView,
    done: Option<&str>,
) -> Markup {
    let cap = view.count_cap;
    let name = &view.name;
    let href = subscription_href(name);
    let settings = &view.settings;
    let paused = view.backlog.as_ref().is_some_and(|b| b.paused);
    layout(
        name,
        "subscription",
        allow_actions,
        html! {
            @if let Some(done) = done { div.banner.healthy #done role="status" { (Shown(done)) } }
            @if paused {
                div.banner.paused #paused role="status" { "Paused: its deliveries are made and wait; none is handed out until it is resumed." }
            }
            h1 { "Subscription " span #name { (Shown(name)) } }
            dl.settings {
                dt { "Patterns" } dd #patterns { (Shown(&settings.patterns.join(", "))) }
                dt { "Max attempts" } dd { (settings.max_attempts) }
                dt { "Ordered" } dd { (if settings.ordered { "yes" } else { "no" }) }
                dt { "State" } dd #state { (if paused { "paused" } else { "delivering" }) }
                dt { "On a dead head" } dd { (serde_json::to_value(settings.on_dead).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()) }
                @if let Some(b) = &view.backlog {
                    dt { "Due" } dd #due { (count(b.due, cap)) }
                    dt { "Scheduled" } dd { (count(b.scheduled, cap)) }
                    dt { "Processing" } dd { (count(b.processing, cap)) }
                    dt { "Dead" } dd #dead { (count(b.dead, cap)) }
                    dt { "Blocked keys" } dd { (count(b.blocked_keys, cap)) }
                    dt { "Oldest due" } dd { (age(b.oldest_due_age)) }
                }
                dt { "Consumers" } dd { (view.consumers.len()) }
            }
            @if allow_actions {
                section.actions {
                    h2 { "Actions" }
                    p.hint { "They need the operator grant for the dashboard's database role (as the schema's owner: SELECT pgbus.grant_operator('ROLE'))." }
                    @if paused {
                        form method="post" action=(format!("{href}/resume")) {
                            (csrf_field(csrf))
                            button #resume type="submit" { "Resume: deliver what waited" }
                        }
                    } @else {
                        form method="post" action=(format!("{href}/pause")) {
                            (csrf_field(csrf))
                            button #pause type="submit" { "Pause: hand out none of its deliveries" }
                        }
                    }
                    form method="post" action=(format!("{href}/retry")) {
                        (csrf_field(csrf))
                        button #retry-all type="submit" { "Retry every dead letter" }
                    }
                    form.purge method="post" action=(format!("{href}/purge"))
                        data-confirm=(format!("Delete every dead letter of {} for good?", plain(name))) {
                        (csrf_field(csrf))
                        label { input type="checkbox" name="confirm" value="yes" required; " I mean it" }
                        button #purge type="submit" { "Purge every dead letter" }
                    }
                    form method="post" action=(format!("{href}/replay")) {
                        (csrf_field(csrf))
                        label { "Replay events since (UTC) " input type="datetime-local" name="since" step="1" required; }
                        button #replay type="submit" { "Replay" }
                    }
                }
            }
            h2 #pending { "Pending deliveries" }
            @if let Some(after) = view.pending_after {
                p.pages {
                    "In event order, from after event #" (after) " · "
                    a #pending-first href=(format!("{href}#pending")) { "the first" }
                }
            }
            @if view.pending.is_empty() {
                p.empty { "No pending delivery." }
            } @else {
                table #pending-list {
                    thead { tr { th { "Event" } th { "Name" } th { "State" } th { "Due" } th { "Attempts" } th { "Key" } } }
                    tbody {
                        @for p in &view.pending {
                            tr.pending data-event-id=[p.event_id.as_deref()] data-state=(p.state) {
                                td.event-id {
                                    @if let Some(id) = &p.event_id { a href=(event_href(id)) { (Shown(id)) } } @else { "(event gone)" }
                                }
                                td { (Shown(p.event_name.as_deref().unwrap_or("–"))) }
                                td.state { (p.state) }
                                td { (time(&p.available_at)) }
                                td { (p.attempts) }
                                td.key { (Shown(p.ordering_key.as_deref().unwrap_or("–"))) }
                            }
                        }
                    }
                }
            }
            @if let Some(next) = view.pending_next {
                p.pages {
                    a #pending-next href=(format!("{href}?pending_after={next}#pending")) {
                        "The next " (super::PENDING_SHOWN) " pending deliveries →"
                    }
                }
            }
            h2 #dead-letters { "Dead letters (" (count(view.dead_letters_total, cap)) ")" }
            @if view.dead_letters_after.is_some() {
                p.pages {
                    "Oldest first, from after " (Shown(view.dead_letters_after.as_deref().unwrap_or(""))) " · "
                    a #dead-first href=(format!("{href}#dead-letters")) { "the oldest" }
                }
            }
            @if view.dead_letters.is_empty() {
                p.empty { "No dead letter." }
            } @else {
                @for d in &view.dead_letters {
                    details.dead-letter data-event-id=[d.dead.event_id.as_deref()] {
                        summary {
                            span.event-name { (Shown(d.dead.event_name.as_deref().unwrap_or("(event gone)"))) }
                            " · " span.event-id { (Shown(d.dead.event_id.as_deref().unwrap_or("–"))) }
                            " · " (d.dead.attempts) " attempts · "
                            @if let Some(at) = &d.dead.failed_at { "died " span.died-at { (time(at)) } " · " }
                            span.last-error { (Shown(d.dead.last_error.as_deref().unwrap_or(""))) }
                        }
                        @if let Some(id) = &d.dead.event_id {
                            p { a href=(event_href(id)) { "The event" } }
                            @if allow_actions {
                                form.inline method="post" action=(format!("{href}/retry")) {
                                    (csrf_field(csrf))
                                    input type="hidden" name="event_id" value=(id);
                                    button.retry type="submit" { "Retry" }
                                }
                            }
                        }
                        h3 { "Failure history" }
                        (failures_table(&d.failures))
                    }
                }
            }
            @if let Some(next) = &view.dead_letters_next {
                p.pages {
                    a #dead-next href=(format!("{href}?after={}#dead-letters", percent(next))) {
                        "The next " (super::DEAD_LETTERS_SHOWN) " dead letters →"
                    }
                }
            }
            h2 { "Blocked keys (" (view.blocked_keys.len()) ")" }
            @if view.blocked_keys.is_empty() {
                p.empty { "No blocked key." }
            } @else {
                table #blocked {
                    thead { tr { th { "Key" } th { "Dead head" } th { "Attempts" } th { "Last error" } th { "Waiting behind" } @if allow_actions { th { "Actions" } } } }
                    tbody {
                        @for k in &view.blocked_keys {
                            tr data-key=(k.key) {
                                td.key { (Shown(&k.key)) }
                                td { a href=(event_href(&k.event_id)) { (Shown(&k.event_name)) " " (Shown(&k.event_id)) } }
                                td { (k.attempts) }
                                td { pre.error { (Shown(k.last_error.as_deref().unwrap_or(""))) } }
                                td {
                                    span.waiting { (k.waiting) }
                                    ul.behind {
                                        @for w in view.waiting.iter().filter(|w| w.key == k.key) {
                                            li data-event-id=(w.event_id) { a href=(event_href(&w.event_id)) { (Shown(&w.event_name)) " " (Shown(&w.event_id)) } }
                                        }
                                    }
                                }
                                @if allow_actions {
                                    td {
                                        form.inline method="post" action=(format!("{href}/keys/redrive")) {
                                            (csrf_field(csrf))
                                            input type="hidden" name="key" value=(k.key);
                                            input type="hidden" name="event_id" value=(k.event_id);
                                            button.redrive type="submit" { "Redrive" }
                                        }
                                        form.inline method="post" action=(format!("{href}/keys/skip")) {
                                            (csrf_field(csrf))
                                            input type="hidden" name="key" value=(k.key);
                                            input type="hidden" name="event_id" value=(k.event_id);
                                            button.skip type="submit" { "Skip" }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            h2 { "Consumers" }
            (consumers_table(&view.consumers))
        },
    )
}

/// A table of consumers (the consumers page's script rebuilds the same rows).
fn consumers_table(consumers: &[ConsumerInfo]) -> Markup {
    html! {
        table #consumer-list {
            thead { tr { th { "Worker" } th { "Subscriptions" } th { "State" } th { "Last heartbeat" } th { "Started" } th { "Process" } } }
            tbody {
                @for c in consumers {
                    tr {
                        td { (Shown(&c.id)) }
                        td { (Shown(&c.subscriptions.join(", "))) }
                        td { (if c.awake { "awake" } else { "asleep" }) }
                        td { (time(&c.last_heartbeat)) }
                        td { (time(&c.started_at)) }
                        td { (Shown(c.info.as_deref().unwrap_or(""))) }
                    }
                }
            }
        }
        @if consumers.is_empty() { p.empty { "No live consumer." } }
    }
}

/// The consumers page.
pub(super) fn consumers(allow_actions: bool, consumers: &[ConsumerInfo]) -> Markup {
    layout(
        "consumers",
        "consumers",
        allow_actions,
        html! {
            div #error.banner.failing role="alert" hidden {}
            h1 { "Consumers" }
            (consumers_table(consumers))
        },
    )
}

/// JSON, pretty-printed.
fn pretty(value: &serde_json::Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// The events page: the search's results.
pub(super) fn events(allow_actions: bool, q: Option<&str>, events: Option<&[EventView]>) -> Markup {
    layout(
        "events",
        "events",
        allow_actions,
        html! {
            h1 { "Events" }
            form.search-big action="/events" method="get" {
                input type="search" name="q" value=[q] placeholder="event id or correlation id"
                    aria-label="event id or correlation id";
                button type="submit" { "Find" }
            }
            @match events {
                None => { p { "Find an event by its id, or every event of a correlation id." } }
                Some([]) => { p.empty { "No event has this id or correlation id." } }
                Some(events) => {
                    @for view in events {
                        @let e = &view.event;
                        section.event data-event-id=(e.id) {
                            h2 { span.event-name { (Shown(&e.name)) } " " span.event-id { (Shown(&e.id)) } }
                            table.envelope {
                                tbody {
                                    tr { th { "Seq" } td { (e.seq.unwrap_or_default()) } }
                                    tr { th { "Id" } td { (Shown(&e.id)) } }
                                    tr { th { "Name" } td { (Shown(&e.name)) } }
                                    tr { th { "Version" } td { (e.version) } }
                                    tr { th { "Source" } td { (Shown(e.source.as_deref().unwrap_or(""))) } }
                                    tr { th { "Aggregate" } td { (Shown(e.aggregate_type.as_deref().unwrap_or(""))) " " (Shown(e.aggregate_id.as_deref().unwrap_or(""))) } }
                                    tr { th { "Correlation id" } td { @if let Some(c) = &e.correlation_id { a href=(event_href(c)) { (Shown(c)) } } } }
                                    tr { th { "Causation id" } td { (Shown(e.causation_id.as_deref().unwrap_or(""))) } }
                                    tr { th { "Ordering key" } td { (Shown(e.ordering_key.as_deref().unwrap_or(""))) } }
                                    tr { th { "Occurred at" } td { @if let Some(t) = &e.occurred_at { (time(t)) } } }
                                    tr { th { "Published at" } td { @if let Some(t) = &e.created_at { (time(t)) } } }
                                }
                            }
                            h3 { "Headers" }
                            pre.json.headers { (Shown(&pretty(&e.headers))) }
                            h3 { "Payload" }
                            pre.json.payload { (Shown(&pretty(&e.payload))) }
                            h3 { "Deliveries" }
                            @if view.deliveries.is_empty() {
                                p.empty { "No subscription has or matches this event." }
                            }
                            @for d in &view.deliveries {
                                div.delivery data-subscription=(d.delivery.subscription) {
                                    h4 {
                                        a href=(subscription_href(&d.delivery.subscription)) { (Shown(&d.delivery.subscription)) }
                                        " " span class=(format!("status {}", d.delivery.status)) { (d.delivery.status) }
                                        @if let Some(a) = d.delivery.attempts { " · " (a) " attempts" }
                                        @if let Some(k) = &d.delivery.ordering_key { " · key " (Shown(k)) @if d.delivery.is_head == Some(false) { " (waiting behind its head)" } }
                                        @if let Some(w) = &d.delivery.locked_by { " · held by " (Shown(w)) }
                                    }
                                    @if let Some(err) = &d.delivery.last_error { pre.error { (Shown(err)) } }
                                    @if !d.failures.is_empty() { (failures_table(&d.failures)) }
                                }
                            }
                        }
                    }
                }
            }
        },
    )
}
