# Stand-in for the official busybox image: Debian's static busybox (1.35) and its applet
# links, on an empty root. Context: a folder holding that binary as `busybox`.
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "--install", "-s", "/bin"]
LABEL io.kubeshard.stand-in="Debian busybox-static 1.35, not the official busybox image"
CMD ["sh"]
