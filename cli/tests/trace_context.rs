//! The command line carries the W3C trace context of a process (OpenTelemetry's
//! `TRACEPARENT` / `TRACESTATE` environment variables) across the bus: `pgbus publish`
//! writes it into the event's headers, `pgbus consume` prints it with them and gives it
//! to an `--exec` command's environment.

mod common;
mod proc;

use proc::{Consumer, count, pgbus_on, run, scratch};
use serde_json::json;

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const STATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";

#[tokio::test]
async fn traceparent_from_the_environment_reaches_consumes_output_and_an_exec_commands_environment()
{
    let db = common::test_db().await;
    let mut printer = Consumer::start(&db, &["-s", "printer", "-p", "order.*"]).await;
    let dir = scratch("traceparent");
    let written = dir.join("traceparent");
    let exec = format!(
        "cat > /dev/null; printf '%s %s' \"$TRACEPARENT\" \"$TRACESTATE\" > '{}'",
        written.display()
    );
    let _runner = Consumer::start(&db, &["-s", "runner", "-p", "order.*", "--exec", &exec]).await;

    let mut publish = pgbus_on(&db);
    publish.env("TRACEPARENT", PARENT).env("TRACESTATE", STATE);
    run(
        publish,
        &["publish", "order.placed", "{}", "--id", "traced"],
    )
    .await
    .ok();

    let line = printer.next().await;
    assert_eq!(line["id"], "traced");
    assert_eq!(
        line["headers"],
        json!({"traceparent": PARENT, "tracestate": STATE})
    );
    common::wait_for("the command's file", common::WAIT, || async {
        std::fs::read_to_string(&written).is_ok_and(|t| !t.is_empty())
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(&written).unwrap(),
        format!("{PARENT} {STATE}")
    );
}

#[tokio::test]
async fn a_header_traceparent_wins_over_the_environment() {
    let db = common::test_db().await;
    let mut printer = Consumer::start(&db, &["-s", "printer", "-p", "*"]).await;
    let given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    let mut publish = pgbus_on(&db);
    publish.env("TRACEPARENT", PARENT).env("TRACESTATE", STATE);
    let header = format!("traceparent={given}");
    run(publish, &["publish", "a.b", "{}", "--header", &header])
        .await
        .ok();
    // The environment's tracestate belongs to its traceparent: neither is taken.
    assert_eq!(
        printer.next().await["headers"],
        json!({"traceparent": given})
    );
}

#[tokio::test]
async fn an_exec_command_gets_no_trace_context_of_consumes_own() {
    let db = common::test_db().await;
    let dir = scratch("no-traceparent");
    let written = dir.join("env");
    let exec = format!(
        "cat > /dev/null; printf '[%s][%s]' \"${{TRACEPARENT-unset}}\" \"${{TRACESTATE-unset}}\" > '{}'",
        written.display()
    );
    let mut consume = pgbus_on(&db);
    consume
        .env("TRACEPARENT", PARENT)
        .env("TRACESTATE", STATE)
        .arg("consume")
        .args(["-s", "runner", "-p", "*", "--exec", &exec])
        .stdout(std::process::Stdio::null());
    let (_child, _stderr) = proc::start_consume(consume).await;
    run(pgbus_on(&db), &["publish", "a.b", "{}"]).await.ok();
    common::wait_for("the command's file", common::WAIT, || async {
        std::fs::read_to_string(&written).is_ok_and(|t| !t.is_empty())
    })
    .await;
    assert_eq!(std::fs::read_to_string(&written).unwrap(), "[unset][unset]");
}

#[tokio::test]
async fn a_malformed_trace_context_is_refused_with_exit_2_and_nothing_published() {
    let db = common::test_db().await;
    let client = db.connect().await;
    /// Environment variables, and extra arguments.
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: &[Case] = &[
        (&[("TRACEPARENT", "not-a-traceparent")], &[]),
        (
            &[(
                "TRACEPARENT",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            )],
            &[],
        ),
        (&[("TRACEPARENT", PARENT), ("TRACESTATE", "Bad Key=1")], &[]),
        (
            &[],
            &[
                "--header",
                "traceparent=00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
            ],
        ),
    ];
    for (env, extra) in cases {
        for lines in [false, true] {
            let mut publish = pgbus_on(&db);
            publish.envs(env.iter().copied());
            let mut args = vec!["publish", "a.b"];
            args.push(if lines { "-" } else { "{}" });
            if lines {
                args.push("--lines");
            }
            args.extend_from_slice(extra);
            let out = if lines {
                proc::run_with(publish, &args, Some("{}\n")).await
            } else {
                run(publish, &args).await
            };
            assert_eq!(out.code, 2, "{env:?} {args:?}: {out:?}");
            assert!(
                out.stderr.contains("invalid traceparent")
                    || out.stderr.contains("invalid tracestate"),
                "{out:?}"
            );
            assert_eq!(out.stdout, "", "{out:?}");
        }
    }
    assert_eq!(count(&client, "SELECT count(*) FROM pgbus.events").await, 0);
}
