// Draws every <canvas id="chart-NAME"> from the page's JSON block (#chart-data, key NAME).
(function () {
  "use strict";
  var block = document.getElementById("chart-data");
  if (!block || typeof Chart === "undefined") return;
  var data = JSON.parse(block.textContent);
  var colors = ["#3b82f6", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#14b8a6"];
  document.querySelectorAll("canvas[id^='chart-']").forEach(function (canvas) {
    var spec = data[canvas.id.slice("chart-".length)];
    if (!spec) return;
    var stacked = canvas.dataset.stacked === "1";
    spec.datasets.forEach(function (d, i) {
      d.backgroundColor = colors[i % colors.length];
      d.borderColor = colors[i % colors.length];
    });
    new Chart(canvas, {
      type: canvas.dataset.kind || "bar",
      data: spec,
      options: {
        animation: false,
        responsive: true,
        scales: { x: { stacked: stacked }, y: { stacked: stacked, beginAtZero: true } }
      }
    });
  });
})();
