// `ares-gateway view` prints its URL with a one-time token in the fragment (#token=...), which the
// browser never sends to a server. Take it out of the address bar and the history first, then log in
// with it through the form (a POST body), as a person would type it.
"use strict";
const found = /^#token=([A-Za-z0-9_-]+)$/.exec(window.location.hash);
if (found) {
  window.history.replaceState(null, "", window.location.pathname);
  const form = document.getElementById("login");
  form.elements.token.value = found[1];
  form.submit();
}
