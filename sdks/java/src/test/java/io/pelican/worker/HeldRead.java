package io.pelican.worker;

import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.io.UncheckedIOException;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * A loopback proxy to a server that holds back the reply of a read: on a connection whose client sent
 * {@code XREADGROUP}, the first reply holding the marker and all after it wait until {@link #release()}. The server
 * delivered what the read asked for; the client does not see it. {@link #reads()} counts the {@code XREADGROUP}
 * requests.
 */
final class HeldRead implements AutoCloseable {
    private final int target;
    private final String marker;
    private final ServerSocket listener;
    private final AtomicBoolean held = new AtomicBoolean();
    private final CountDownLatch released = new CountDownLatch(1);
    private final AtomicInteger reads = new AtomicInteger();

    HeldRead(int target, String marker) {
        this.target = target;
        this.marker = marker;
        try {
            this.listener = new ServerSocket(0, 50, InetAddress.getLoopbackAddress());
        } catch (IOException e) {
            throw new UncheckedIOException(e);
        }
        Thread accepting = new Thread(this::accept, "held-read-accept");
        accepting.setDaemon(true);
        accepting.start();
    }

    int port() {
        return listener.getLocalPort();
    }

    int reads() {
        return reads.get();
    }

    void release() {
        released.countDown();
    }

    @Override
    public void close() throws IOException {
        released.countDown();
        listener.close();
    }

    private void accept() {
        while (!listener.isClosed()) {
            try {
                Socket client = listener.accept();
                Socket server = new Socket(InetAddress.getLoopbackAddress(), target);
                AtomicBoolean reader = new AtomicBoolean();
                pump("up", client, server, reader, true);
                pump("down", server, client, reader, false);
            } catch (IOException e) {
                return; // closed
            }
        }
    }

    private void pump(String name, Socket from, Socket to, AtomicBoolean reader, boolean upstream) {
        Thread thread = new Thread(() -> {
            byte[] buffer = new byte[65536];
            try (InputStream in = from.getInputStream(); OutputStream out = to.getOutputStream()) {
                for (int read; (read = in.read(buffer)) > 0; ) {
                    String text = new String(buffer, 0, read, StandardCharsets.ISO_8859_1);
                    if (upstream) {
                        // Lettuce writes each command whole: on loopback a command's name comes in one chunk.
                        int sent = text.toUpperCase().split("XREADGROUP", -1).length - 1;
                        reads.addAndGet(sent);
                        if (sent > 0) {
                            reader.set(true);
                        }
                    } else if (reader.get() && text.contains(marker) && held.compareAndSet(false, true)) {
                        released.await(); // what comes after waits in the socket meanwhile
                    }
                    out.write(buffer, 0, read);
                    out.flush();
                }
            } catch (IOException e) {
                // the other side closed
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            } finally {
                close(from);
                close(to);
            }
        }, "held-read-" + name);
        thread.setDaemon(true);
        thread.start();
    }

    private static void close(Socket socket) {
        try {
            socket.close();
        } catch (IOException e) {
            // closed already
        }
    }
}
