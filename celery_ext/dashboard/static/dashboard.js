// Live pages (body data-refresh="SECONDS") read themselves again and swap in the new
// figures; a refresh never runs while a form field has the focus.
(function () {
  "use strict";
  var seconds = parseFloat(document.body.dataset.refresh || "");
  if (!(seconds > 0)) { return; }
  function refresh() {
    var active = document.activeElement;
    if (active && active.form) { return; }
    fetch(window.location.href, {credentials: "same-origin"})
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html === null) { return; }
        var fresh = new DOMParser().parseFromString(html, "text/html");
        var live = fresh.getElementById("live");
        if (live) { document.getElementById("live").innerHTML = live.innerHTML; }
        var stamp = fresh.getElementById("stamp");
        if (stamp) { document.getElementById("stamp").textContent = stamp.textContent; }
      })
      .catch(function () {});
  }
  window.setInterval(refresh, seconds * 1000);
}());
