// pgbus ui: live updates of the overview and the consumers page, drawn from the JSON
// endpoints. Data only ever reaches the page through text nodes and attributes set
// with setAttribute: never as HTML. Invisible, bidirectional and control characters in
// the data are shown as marked codes (<U+202E>), as the server's pages show them.
"use strict";

(function () {
  var POLL_MS = 1000;

  // The characters shown as codes: the same set as `hidden` in ui/security.rs.
  var HIDDEN = new RegExp("[\\u0000-\\u0008\\u000B-\\u001F\\u007F-\\u00A0\\u00AD\\u034F" +
    "\\u061C\\u115F\\u1160\\u1680\\u17B4\\u17B5\\u180B-\\u180F\\u2000-\\u200F" +
    "\\u2028-\\u202F\\u205F-\\u206F\\u2800\\u3000\\u3164\\uFE00-\\uFE0F\\uFEFF\\uFFA0" +
    "\\uFFF0-\\uFFFB\\u{1BCA0}-\\u{1BCA3}\\u{1D173}-\\u{1D17A}\\u{E0000}-\\u{E0FFF}]", "gu");

  function code(c) {
    var hex = c.codePointAt(0).toString(16).toUpperCase();
    while (hex.length < 4) { hex = "0" + hex; }
    return "<U+" + hex + ">";
  }

  // Replaces node's content with text, each hidden character as a marked code.
  function show(node, text) {
    text = String(text);
    node.replaceChildren();
    var last = 0;
    HIDDEN.lastIndex = 0;
    var m;
    while ((m = HIDDEN.exec(text)) !== null) {
      if (m.index > last) { node.appendChild(document.createTextNode(text.slice(last, m.index))); }
      var mark = document.createElement("span");
      mark.className = "cc";
      mark.title = "an invisible or control character";
      mark.textContent = code(m[0]);
      node.appendChild(mark);
      last = m.index + m[0].length;
    }
    if (last < text.length) { node.appendChild(document.createTextNode(text.slice(last))); }
    return node;
  }

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    if (attrs) {
      Object.keys(attrs).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    }
    if (text !== undefined && text !== null) { show(node, text); }
    return node;
  }

  function count(n, cap) { return n >= cap ? n + "+" : String(n); }

  function age(seconds) {
    if (seconds === null || seconds === undefined) { return "–"; }
    if (seconds < 1) { return Math.round(seconds * 1000) + "ms"; }
    if (seconds < 60) { return seconds.toFixed(1) + "s"; }
    var s = Math.floor(seconds);
    if (s < 3600) { return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s"; }
    if (s < 86400) { return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m"; }
    return Math.floor(s / 86400) + "d" + String(Math.floor(s % 86400 / 3600)).padStart(2, "0") + "h";
  }

  function showError(message) {
    var banner = document.getElementById("error");
    if (!banner) { return; }
    if (message) {
      show(banner, "The database cannot be read: " + message);
      banner.hidden = false;
    } else {
      banner.textContent = "";
      banner.hidden = true;
    }
  }

  // A chart of the history: delivered/s (green) and backlog (blue), each scaled to its
  // own maximum.
  function draw(canvas, history) {
    var ctx = canvas.getContext("2d");
    if (!ctx) { return; }
    var w = canvas.width, h = canvas.height;
    ctx.clearRect(0, 0, w, h);
    if (!history || history.length === 0) { return; }
    function line(values, colour) {
      var max = Math.max.apply(null, values.concat([1]));
      ctx.strokeStyle = colour;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      values.forEach(function (v, i) {
        var x = values.length === 1 ? w : i * (w - 1) / (values.length - 1);
        var y = h - 2 - (v / max) * (h - 4);
        if (i === 0) { ctx.moveTo(x, y); } else { ctx.lineTo(x, y); }
      });
      ctx.stroke();
    }
    line(history.map(function (p) { return p.backlog; }), "#2f6fd0");
    line(history.map(function (p) { return p.delivered_per_second; }), "#1f9d55");
  }

  function subscriptionRow(sub, cap) {
    var tr = el("tr", { "data-name": sub.name, "class": sub.health });
    var name = el("td", { "class": "name" });
    name.appendChild(el("a", { href: "/subscriptions/" + encodeURIComponent(sub.name) }, sub.name));
    tr.appendChild(name);
    var health = el("td");
    health.appendChild(el("span", { "class": "health" }, sub.health));
    tr.appendChild(health);
    tr.appendChild(el("td", { "class": "due" }, count(sub.due, cap)));
    tr.appendChild(el("td", { "class": "scheduled" }, count(sub.scheduled, cap)));
    tr.appendChild(el("td", { "class": "processing" }, count(sub.processing, cap)));
    tr.appendChild(el("td", { "class": "dead" }, count(sub.dead, cap)));
    tr.appendChild(el("td", { "class": "blocked" }, count(sub.blocked_keys, cap)));
    tr.appendChild(el("td", { "class": "age" }, age(sub.oldest_due_age)));
    tr.appendChild(el("td", { "class": "consumers" },
      sub.consumers_awake + " awake / " + sub.consumers_asleep + " asleep"));
    tr.appendChild(el("td", { "class": "rate" },
      (sub.throughput_estimated ? "~" : "") + sub.delivered_per_second.toFixed(1)));
    var chart = el("td", { "class": "chart" });
    var canvas = el("canvas", { width: "240", height: "48" });
    chart.appendChild(canvas);
    tr.appendChild(chart);
    draw(canvas, sub.history);
    return tr;
  }

  function refreshOverview() {
    return fetch("/api/overview", { credentials: "same-origin" })
      .then(function (r) { return r.json(); })
      .then(function (o) {
        showError(o.error);
        var long = document.getElementById("long-transaction");
        if (long) {
          long.textContent = o.long_transaction || "";
          long.hidden = !o.long_transaction;
        }
        document.getElementById("queue").textContent = (o.notification_queue_usage * 100).toFixed(2) + "%";
        document.getElementById("listeners").textContent = String(o.listeners);
        document.getElementById("consumers").textContent = String(o.consumers);
        document.getElementById("sleeping").textContent = String(o.sleeping_consumers);
        document.getElementById("not-fanned-out").textContent = String(o.not_fanned_out);
        document.getElementById("sampled").textContent = o.sampled_at || "never";
        var tbody = document.querySelector("#subs tbody");
        var rows = document.createDocumentFragment();
        o.subscriptions.forEach(function (sub) { rows.appendChild(subscriptionRow(sub, o.count_cap)); });
        tbody.replaceChildren(rows);
        document.body.setAttribute("data-refreshed", String(Date.now()));
      })
      .catch(function (e) { showError("the dashboard does not answer (" + e + ")"); });
  }

  function refreshConsumers() {
    return fetch("/api/consumers", { credentials: "same-origin" })
      .then(function (r) { return r.json(); })
      .then(function (o) {
        if (o.error) { showError(o.error); return; }
        showError(null);
        var tbody = document.querySelector("#consumer-list tbody");
        var rows = document.createDocumentFragment();
        o.consumers.forEach(function (c) {
          var tr = el("tr");
          tr.appendChild(el("td", null, c.id));
          tr.appendChild(el("td", null, c.subscriptions.join(", ")));
          tr.appendChild(el("td", null, c.awake ? "awake" : "asleep"));
          tr.appendChild(el("td", null, c.last_heartbeat));
          tr.appendChild(el("td", null, c.started_at));
          tr.appendChild(el("td", null, c.info || ""));
          rows.appendChild(tr);
        });
        tbody.replaceChildren(rows);
        document.body.setAttribute("data-refreshed", String(Date.now()));
      })
      .catch(function (e) { showError("the dashboard does not answer (" + e + ")"); });
  }

  function poll(refresh) {
    var busy = false;
    setInterval(function () {
      if (busy) { return; }
      busy = true;
      refresh().then(function () { busy = false; }, function () { busy = false; });
    }, POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", function () {
    var page = document.body.getAttribute("data-page");
    if (page === "overview") {
      // The server drew the rows; the charts need the history.
      refreshOverview();
      poll(refreshOverview);
    } else if (page === "consumers") {
      poll(refreshConsumers);
    }
    document.querySelectorAll("form[data-confirm]").forEach(function (form) {
      form.addEventListener("submit", function (event) {
        if (!window.confirm(form.getAttribute("data-confirm"))) { event.preventDefault(); }
      });
    });
  });
})();
