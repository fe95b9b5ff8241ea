// dafka console: renders the JSON of the console's API.  Every name and every
// record content goes into the page as text (textContent / createTextNode),
// never as markup.
"use strict";

(function () {
  const body = document.body;
  const content = document.getElementById("content");
  const live = document.getElementById("live");
  const NS = "http://www.w3.org/2000/svg";

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = v;
      else if (k === "onclick") node.addEventListener("click", v);
      else node.setAttribute(k, v);
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
    }
    return node;
  }

  function table(headers, rows, cls) {
    const t = el("table", cls ? { class: cls } : {});
    t.appendChild(el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", { text: h })))));
    const tb = el("tbody");
    for (const r of rows) tb.appendChild(el("tr", {}, ...r.map((c) => (c instanceof Node ? el("td", {}, c) : el("td", { text: c === null || c === undefined ? "-" : String(c) })))));
    t.appendChild(tb);
    return t;
  }

  function section(id, title, ...children) {
    return el("section", { id }, el("h2", { text: title }), ...children);
  }

  function short(addr) { return addr ? addr.slice(0, 8) : ""; }
  function bytes(n) {
    if (n === null || n === undefined) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }
  function link(prefix, name) { return el("a", { href: prefix + encodeURIComponent(name), text: name }); }
  function getJSON(url) { return fetch(url, { cache: "no-store" }).then((r) => r.json().then((j) => ({ ok: r.ok, data: j }))); }

  // ------------------------------------------------------------------ the mesh picture

  const expanded = new Set();  // boxes the user opened (kept across updates)

  function meshPicture(mesh) {
    const cols = { store: [], producer: [], consumer: [] };
    for (const b of mesh.boxes) (cols[b.kind] || cols.consumer).push(b);
    const colX = { producer: 20, store: 300, consumer: 580 };
    const w = 240, rowH = 22, gap = 14;
    const pos = {};
    let height = 40;
    for (const [kind, boxes] of Object.entries(cols)) {
      let y = 30;
      for (const b of boxes) {
        const open = expanded.has(b.id);
        const lines = open ? b.members.length : 0;
        const h = rowH * (1 + lines) + 6;
        pos[b.id] = { x: colX[kind], y, h, b, open, lines };
        y += h + gap;
      }
      height = Math.max(height, y);
    }
    const svg = document.createElementNS(NS, "svg");
    svg.setAttribute("width", "840");
    svg.setAttribute("height", String(height));
    svg.setAttribute("class", "mesh");
    function s(tag, attrs, text) {
      const n = document.createElementNS(NS, tag);
      for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
      if (text !== undefined) n.textContent = text;
      svg.appendChild(n);
      return n;
    }
    for (const [kind, x] of Object.entries(colX)) {
      s("text", { x, y: 16, class: "colhead" }, { producer: "producers, by topic", store: "stores", consumer: "groups and consumers" }[kind]);
    }
    for (const [a, b] of mesh.links) {
      const p = pos[a], q = pos[b];
      if (!p || !q) continue;
      const [l, r] = p.x < q.x ? [p, q] : [q, p];
      s("line", { x1: l.x + w, y1: l.y + rowH / 2 + 3, x2: r.x, y2: r.y + rowH / 2 + 3, class: "link", "data-link": a + " -- " + b });
    }
    for (const p of Object.values(pos)) {
      const g = document.createElementNS(NS, "g");
      g.setAttribute("class", "box " + p.b.kind);
      g.setAttribute("data-id", p.b.id);
      svg.appendChild(g);
      const rect = document.createElementNS(NS, "rect");
      for (const [k, v] of Object.entries({ x: p.x, y: p.y, width: w, height: p.h, rx: 4 })) rect.setAttribute(k, String(v));
      g.appendChild(rect);
      const label = document.createElementNS(NS, "text");
      label.setAttribute("x", String(p.x + 8));
      label.setAttribute("y", String(p.y + 16));
      const n = p.b.count;
      const what = p.b.kind === "store" ? "" : " (" + n + (p.b.kind === "producer" ? " producer" : " member") + (n === 1 ? ")" : "s)");
      label.textContent = (p.b.kind === "store" ? "store " : "") + p.b.label + what + (n > 0 && p.b.kind !== "store" ? (p.open ? " \u25be" : " \u25b8") : "");
      g.appendChild(label);
      for (let i = 0; i < p.lines; i++) {
        const t = document.createElementNS(NS, "text");
        t.setAttribute("x", String(p.x + 18));
        t.setAttribute("y", String(p.y + 16 + rowH * (i + 1)));
        t.setAttribute("class", "member");
        t.textContent = p.b.members[i] + (i === p.lines - 1 && n > p.lines ? " ... " + (n - p.lines) + " more" : "");
        g.appendChild(t);
      }
      g.addEventListener("click", () => {
        if (expanded.has(p.b.id)) expanded.delete(p.b.id); else expanded.add(p.b.id);
        if (lastLanding) renderLanding(lastLanding);
      });
    }
    return svg;
  }

  // ------------------------------------------------------------------ landing

  let lastLanding = null;

  function renderLanding(d) {
    lastLanding = d;
    const parts = [];
    if (d.alerts.length) parts.push(section("alerts", "Alerts", el("ul", {}, ...d.alerts.map((a) => el("li", { text: a })))));
    parts.push(section("topics", "Topics", d.topics.length ? table(
      ["topic", "partitions", "records", "bytes", "heads"],
      d.topics.map((t) => [link("/topics/", t.topic), t.partitions, t.records, d.db ? bytes(t.bytes) : "(--db)",
        t.heads.slice(0, 8).map((h) => short(h.partition) + ":" + (h.head === null ? "-" : h.head)).join("  ") + (t.partitions > 8 ? "  ... (" + t.partitions + " partitions)" : "")]),
      "topics") : el("p", { text: "no topic seen yet" })));
    parts.push(section("groups", "Consumer groups", d.groups.length ? table(
      ["group", "members", "lag", "lag per partition"],
      d.groups.map((g) => [link("/groups/", g.group), g.members, g.lag,
        g.partitions.slice(0, 8).map((p) => p.topic + "/" + short(p.partition) + ": " + (p.lag === null ? "-" : p.lag)).join("  ") + (g.partition_count > 8 ? "  ... (" + g.partition_count + " partitions)" : "")]),
      "groups") : el("p", { text: "no group seen yet" })));
    parts.push(section("mesh", "Mesh (click a box to list its nodes)", meshPicture(d.mesh)));
    const nodes = [];
    for (const [kind, list] of Object.entries(d.nodes)) {
      const count = d.node_counts[kind];
      if (!count) continue;
      nodes.push(el("h3", { text: kind + "s (" + count + ")" }));
      nodes.push(table(["address", "endpoint", "state", "last beacon"], list.map((n) => [n.address || "-", n.endpoint, n.alive ? "up" : "down",
        n.age === undefined ? "-" : n.age.toFixed(1) + " s ago"]), "nodes " + kind));
      if (count > list.length) nodes.push(el("p", { text: "... " + (count - list.length) + " more" }));
    }
    parts.push(section("nodes", "Nodes", ...nodes));
    content.replaceChildren(...parts);
  }

  function startLanding() {
    getJSON("/api/state").then((r) => renderLanding(r.data));
    const es = new EventSource("/events");
    es.onopen = () => { live.textContent = "live"; live.className = "on"; };
    es.onerror = () => { live.textContent = "reconnecting"; live.className = "off"; };
    es.onmessage = (ev) => renderLanding(JSON.parse(ev.data));
  }

  // ------------------------------------------------------------------ charts

  const charts = new Map();  // holder -> its uPlot (one per holder, fed new data)

  function chart(holder, title, points, label) {
    chartSeries(holder, title, label, points.map((p) => p[0]), [{ label, values: points.map((p) => p[1]) }]);
  }

  // Several series over the same sample times (xs: monotonic seconds).
  function chartSeries(holder, title, label, xs, series) {
    if (typeof uPlot === "undefined" || xs.length < 2 || !series.length) {
      if (!charts.has(holder)) holder.replaceChildren(el("p", { class: "note", text: title + ": not enough samples yet" }));
      return;
    }
    const t0 = xs[xs.length - 1];
    const data = [xs.map((x) => x - t0), ...series.map((s) => s.values)];
    const key = series.map((s) => s.label).join("\u0000");
    const old = charts.get(holder);
    if (old && old.key === key) { old.u.setData(data); return; }
    if (old) old.u.destroy();
    holder.replaceChildren();
    const colors = ["#2b6cb0", "#c05621", "#2f855a", "#9b2c2c", "#6b46c1", "#b7791f", "#2c7a7b", "#97266d", "#4a5568"];
    const opts = {
      title, width: 640, height: 220,
      scales: { x: { time: false } },
      axes: [{ label: "seconds ago" }, { label }],
      series: [{}, ...series.map((s, i) => ({ label: s.label, stroke: colors[i % colors.length], width: 2 }))],
    };
    charts.set(holder, { key, u: new uPlot(opts, data, holder) });
  }

  // ------------------------------------------------------------------ topic

  function startTopic(name) {
    const parts = el("div", { id: "partitions" });
    const rate = el("div", { id: "rate-chart" });
    const lagChart = el("div", { id: "topic-lag-chart" });
    const browser = el("div", { id: "browser" });
    content.replaceChildren(section("parts", "Partitions", parts), section("rate", "Records/s", rate), section("lag", "Lag of the groups consuming it", lagChart), section("records", "Records", browser));
    const sel = el("select", { id: "partition" });
    const offset = el("input", { id: "offset", type: "number", min: "0", placeholder: "latest" });
    const when = el("input", { id: "time", type: "datetime-local", step: "1" });
    const fmt = el("select", { id: "format" }, ...["auto", "text", "json", "msgpack", "hex"].map((f) => el("option", { value: f, text: f })));
    const out = el("div", { id: "record-list" });
    let shown = null;
    function load(from, at) {
      const q = new URLSearchParams({ topic: name, partition: sel.value, format: fmt.value, limit: "20" });
      if (from !== null && from !== undefined && from !== "") q.set("offset", String(from));
      if (at !== undefined && !Number.isNaN(at)) q.set("time", String(at));
      getJSON("/api/records?" + q).then((r) => {
        if (!r.ok) { out.replaceChildren(el("p", { class: "note", text: r.data.error })); return; }
        shown = r.data;
        const rows = r.data.records.map((x) => {
          const c = x.content;
          const pre = el("pre", { class: "content " + c.as, text: c.text });
          const note = el("span", { class: "note", text: c.as + ", " + c.size + " bytes" + (c.truncated ? ", truncated: first " + c.text.length + (c.as === "hex" ? " characters" : " characters") + " shown" : "") });
          const key = x.key === null ? "-" : x.key.text;
          return [x.offset, x.ts_ms === null ? "-" : new Date(x.ts_ms).toISOString(), key, el("div", {}, pre, note)];
        });
        const d = r.data;
        const notes = [];
        if (d.cut) notes.push("page cut at 8 MiB of contents: \"newer\" goes on");
        if (d.timed_out) notes.push("no answer for every record in time: showing what came");
        if (d.missing) notes.push(d.missing + " offset(s) of the page not read (holes)");
        const what = d.source === "mesh" ? "read over the mesh (head " + (d.last === null ? "-" : d.last) + ")"
          : "offsets " + d.first + ".." + d.last + " stored";
        out.replaceChildren(el("p", { id: "record-note", text: what + "; showing from " + d.offset + (notes.length ? " (" + notes.join("; ") + ")" : "") }),
          table(["offset", "time", "key", "content"], rows, "records"));
      });
    }
    const older = el("button", { id: "older", text: "older", onclick: () => shown && load(Math.max(shown.first || 0, shown.offset - 20)) });
    const newer = el("button", { id: "newer", text: "newer", onclick: () => shown && load(shown.next) });
    const latest = el("button", { id: "latest", text: "latest", onclick: () => { offset.value = ""; load(null); } });
    const go = el("button", { id: "go", text: "show", onclick: () => load(offset.value) });
    const goTime = el("button", { id: "go-time", text: "show", onclick: () => load(null, new Date(when.value).getTime()) });
    browser.replaceChildren(el("div", { class: "controls" }, "partition ", sel, " from offset ", offset, " ", go,
      " or from (local time) ", when, " ", goTime, " as ", fmt, " ", latest, older, newer), out);
    let first = true;
    let pfrom = 0;  // the first partition of the page shown (a topic may have thousands)
    const pnote = el("span", { id: "partition-page" });
    const pprev = el("button", { id: "partitions-prev", text: "previous", onclick: () => { pfrom = Math.max(0, pfrom - 200); refresh(); } });
    const pnext = el("button", { id: "partitions-next", text: "next", onclick: () => { pfrom += 200; refresh(); } });
    const ptable = el("div");
    parts.replaceChildren(el("div", { class: "controls" }, pnote, " ", pprev, pnext), ptable);
    function refresh() {
      getJSON("/api/topic?name=" + encodeURIComponent(name) + "&from=" + pfrom).then((r) => {
        if (!r.ok) { ptable.replaceChildren(el("p", { class: "note", text: r.data.error })); return; }
        const d = r.data;
        pfrom = d.from;
        live.textContent = "live"; live.className = "on";
        pnote.textContent = "partitions " + (d.from + 1) + "-" + (d.from + d.partitions.length) + " of " + d.partition_count;
        pprev.disabled = d.from === 0;
        pnext.disabled = d.from + d.partitions.length >= d.partition_count;
        ptable.replaceChildren(table(["partition", "first", "head", "records", "bytes", "records/s", "producer", "stores (head/lag)"],
          d.partitions.map((p) => [p.partition, p.first, p.head, p.records, bytes(p.bytes), p.rate,
            p.producer_head === null ? "-" : p.producer_head + (p.producer_alive ? "" : " (gone)"),
            p.stores.map((s) => short(s.address) + ":" + s.head + "/" + s.lag).join("  ") || "-"]), "partitions"));
        // The partitions of the page shown (and the one chosen, if on another page).
        const chosen = sel.value;
        const names = d.partitions.map((p) => p.partition);
        if (chosen && !names.includes(chosen)) names.unshift(chosen);
        if (Array.from(sel.options).map((o) => o.value).join("\u0000") !== names.join("\u0000")) {
          sel.replaceChildren(...names.map((n) => el("option", { value: n, text: n })));
          if (chosen) sel.value = chosen;
        }
        chart(rate, "records/s (all partitions)", d.rate, "records/s");
        if (!d.lag.length) { if (!charts.has(lagChart)) lagChart.replaceChildren(el("p", { class: "note", text: "no group consumes it (yet)" })); }
        else {
          // On the sample times of the most lagging group (the groups are sampled together).
          const xs = d.lag[0].points.map((p) => p[0]);
          chartSeries(lagChart, "lag (records, the topic's partitions summed)", "records", xs, d.lag.map((g) => {
            const at = new Map(g.points.map((p) => [p[0], p[1]]));
            return { label: g.group, values: xs.map((x) => (at.has(x) ? at.get(x) : null)) };
          }));
        }
        when.disabled = goTime.disabled = !d.db;
        when.title = goTime.title = d.db ? "" : "records carry no timestamp over the mesh: from a time needs --db";
        if (first && d.partitions.length) { first = false; load(null); }
      });
    }
    refresh();
    setInterval(refresh, 2000);
  }

  // ------------------------------------------------------------------ group

  function startGroup(name) {
    const members = el("div", { id: "members" });
    const parts = el("div", { id: "positions" });
    let pfrom = 0;  // the first partition of the page shown
    const lag = el("div", { id: "lag-chart" });
    content.replaceChildren(section("m", "Members", members), section("p", "Positions and lag", parts), section("l", "Lag", lag));
    function refresh() {
      getJSON("/api/group?name=" + encodeURIComponent(name) + "&from=" + pfrom).then((r) => {
        if (!r.ok) { members.replaceChildren(el("p", { class: "note", text: r.data.error })); return; }
        const d = r.data;
        live.textContent = "live"; live.className = "on";
        members.replaceChildren(table(["member", "topics", "claims"], d.members.map((m) => [m.address, m.topics.join(", "), m.claims.map((c) => c[0] + "/" + short(c[1])).join("  ") || "-"])));
        pfrom = d.from;
        const prev = el("button", { text: "previous", onclick: () => { pfrom = Math.max(0, pfrom - 200); refresh(); } });
        const next = el("button", { text: "next", onclick: () => { pfrom += 200; refresh(); } });
        prev.disabled = d.from === 0;
        next.disabled = d.from + d.partitions.length >= d.partition_count;
        parts.replaceChildren(el("p", { text: "total lag " + d.lag }),
          el("div", { class: "controls" }, "partitions " + (d.from + 1) + "-" + (d.from + d.partitions.length) + " of " + d.partition_count + " ", prev, next),
          table(["topic", "partition", "owner", "head", "committed", "lag"],
            d.partitions.map((p) => [p.topic, p.partition, p.owner ? short(p.owner) : "-", p.head, p.committed, p.lag]), "positions"));
        // The summed lag and the most lagging partitions', on the sum's sample times.
        const xs = d.history.map((p) => p[0]);
        const series = [{ label: "all partitions", values: d.history.map((p) => p[1]) }];
        for (const h of d.partition_history) {
          const at = new Map(h.points.map((p) => [p[0], p[1]]));
          series.push({ label: h.topic + "/" + short(h.partition), values: xs.map((x) => (at.has(x) ? at.get(x) : null)) });
        }
        chartSeries(lag, "lag (records)", "records", xs, series);
      });
    }
    refresh();
    setInterval(refresh, 2000);
  }

  const kind = body.dataset.page;
  if (kind === "landing") startLanding();
  else if (kind === "topic") startTopic(body.dataset.name);
  else if (kind === "group") startGroup(body.dataset.name);
})();
