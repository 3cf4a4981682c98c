// Tell the server the operator's timezone: times on every page are rendered in it
// (runs.middleware.OperatorTimezoneMiddleware reads this cookie). The first page of a
// session is rendered in the server's default; the next request, including htmx polls,
// already uses the browser's zone.
(function () {
  "use strict";
  var zone;
  try {
    zone = Intl.DateTimeFormat().resolvedOptions().timeZone;
  } catch (e) {
    return;
  }
  if (!zone) return;
  var current = document.cookie.split("; ").filter(function (c) {
    return c.indexOf("tz=") === 0;
  })[0];
  // IANA names hold only letters, digits, "/", "_", "-" and "+": all valid in a cookie
  if (!/^[A-Za-z0-9_+\-\/]+$/.test(zone)) return;
  if (current !== "tz=" + zone) {
    document.cookie = "tz=" + zone + "; path=/; max-age=31536000; SameSite=Lax";
  }
})();
